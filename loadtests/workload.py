"""Agent-session traces: a seeded generator, saved as JSONL so that any run can be replayed.

A session is what one coding agent does for one task: turns, one after another, each a burst of
parallel calls (the model's tool calls fanned out within ``burst_window_s``), with a pause
between turns while the tools run. Every session has a tier, a client behaviour (how it
retries when refused) and a deadline; the deadline is a multiple of how long the session would
take alone on an idle engine, computed from the nominal unloaded latency the sweep measured.

Pure: the same spec and seed give the same trace, byte for byte.
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schemas.vocab import Tier


class ClientKind(enum.StrEnum):
    POLITE = "polite"
    """Honours ``Retry-After`` (with jitter) within a retry budget and the session deadline."""
    NAIVE = "naive"
    """Retries at once, up to its budget: what a retry loop without back-off does."""


@dataclass(frozen=True)
class CallSpec:
    call_id: str
    offset_s: float
    """When the call starts, after its turn starts: the fan-out burst."""
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TurnSpec:
    think_s: float
    """Pause before the turn starts, after the previous one ended (tools running)."""
    calls: tuple[CallSpec, ...]


@dataclass(frozen=True)
class SessionTrace:
    session_id: str
    arrival_s: float
    tier: Tier
    client: ClientKind
    deadline_s: float
    """From arrival; the agent gives up on the session then."""
    turns: tuple[TurnSpec, ...]

    @property
    def calls(self) -> list[CallSpec]:
        return [call for turn in self.turns for call in turn.calls]

    @property
    def max_parallel(self) -> int:
        return max(len(turn.calls) for turn in self.turns)

    @property
    def mean_prompt_tokens(self) -> int:
        """What the agent declares per call: its typical call, rounded up."""
        calls = self.calls
        return -(-sum(call.prompt_tokens for call in calls) // len(calls))

    @property
    def mean_output_tokens(self) -> int:
        calls = self.calls
        return -(-sum(call.output_tokens for call in calls) // len(calls))


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length, clipped to [low, high]: most calls short, a few long."""

    median: int
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        value = round(self.median * math.exp(rng.gauss(0.0, self.sigma)))
        return min(self.high, max(self.low, value))


@dataclass(frozen=True)
class WorkloadSpec:
    calls_per_session: tuple[int, int] = (5, 40)
    fanout: tuple[int, int] = (1, 6)
    """Calls per turn, uniform in this range (clipped to what the session has left)."""
    burst_window_s: float = 2.0
    think_s: tuple[float, float] = (0.1, 0.6)
    prompt: LengthDist = LengthDist(median=96, sigma=0.5, low=16, high=320)
    output: LengthDist = LengthDist(median=24, sigma=0.5, low=4, high=96)
    tier_mix: dict[Tier, float] = field(
        default_factory=lambda: {Tier.GUARANTEED: 0.2, Tier.STANDARD: 0.5, Tier.BESTEFFORT: 0.3}
    )
    naive_share: float = 0.3
    deadline_slack: tuple[float, float] = (3.0, 6.0)
    """A session's deadline, as a multiple of how long it would take alone on an idle engine."""
    nominal_ttft_s: float = 0.05
    nominal_tpot_s: float = 0.005
    """Unloaded latency used for deadlines: the sweep sets these from its own measurement."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tier_mix"] = {tier.value: share for tier, share in self.tier_mix.items()}
        return data


def unloaded_duration_s(turns: Sequence[TurnSpec], ttft_s: float, tpot_s: float) -> float:
    """How long the session takes alone: every turn waits for its slowest call."""
    return sum(
        turn.think_s
        + max(
            call.offset_s + ttft_s + max(call.output_tokens - 1, 0) * tpot_s for call in turn.calls
        )
        for turn in turns
    )


def _session(
    spec: WorkloadSpec, rng: random.Random, session_id: str, arrival_s: float
) -> SessionTrace:
    total = rng.randint(*spec.calls_per_session)
    turns: list[TurnSpec] = []
    made = 0
    while made < total:
        width = min(rng.randint(*spec.fanout), total - made)
        calls = []
        for i in range(width):
            # The first call of a turn starts the burst; the rest follow within the window.
            offset = 0.0 if i == 0 else rng.uniform(0.0, spec.burst_window_s)
            calls.append(
                CallSpec(
                    call_id=f"{session_id}-c{made + i}",
                    offset_s=round(offset, 3),
                    prompt_tokens=spec.prompt.sample(rng),
                    output_tokens=spec.output.sample(rng),
                )
            )
        think = 0.0 if not turns else rng.uniform(*spec.think_s)
        turns.append(TurnSpec(think_s=round(think, 3), calls=tuple(calls)))
        made += width
    tiers = list(spec.tier_mix)
    tier = rng.choices(tiers, weights=[spec.tier_mix[t] for t in tiers])[0]
    client = ClientKind.NAIVE if rng.random() < spec.naive_share else ClientKind.POLITE
    alone = unloaded_duration_s(turns, spec.nominal_ttft_s, spec.nominal_tpot_s)
    deadline = alone * rng.uniform(*spec.deadline_slack)
    return SessionTrace(
        session_id=session_id,
        arrival_s=round(arrival_s, 3),
        tier=tier,
        client=client,
        deadline_s=round(deadline, 3),
        turns=tuple(turns),
    )


def generate(
    spec: WorkloadSpec, *, rate: float, duration_s: float, seed: int
) -> list[SessionTrace]:
    """Sessions arriving as a Poisson process of ``rate`` per second over ``duration_s``.

    Arrival times come from their own random stream, so traces of the same seed at different
    rates hold the same sessions, only closer together or further apart (a sweep over load
    then varies load and nothing else)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be positive")
    arrivals = random.Random(f"{seed}:arrivals")
    shapes = random.Random(f"{seed}:sessions")
    sessions: list[SessionTrace] = []
    t = arrivals.expovariate(rate)
    while t < duration_s:
        sessions.append(_session(spec, shapes, f"s{seed}-{len(sessions):04d}", t))
        t += arrivals.expovariate(rate)
    return sessions


# -- JSONL ------------------------------------------------------------------------------------


def _session_json(session: SessionTrace) -> dict[str, Any]:
    return asdict(session)


def _session_from(data: dict[str, Any]) -> SessionTrace:
    return SessionTrace(
        session_id=data["session_id"],
        arrival_s=float(data["arrival_s"]),
        tier=Tier(data["tier"]),
        client=ClientKind(data["client"]),
        deadline_s=float(data["deadline_s"]),
        turns=tuple(
            TurnSpec(
                think_s=float(turn["think_s"]),
                calls=tuple(CallSpec(**call) for call in turn["calls"]),
            )
            for turn in data["turns"]
        ),
    )


def dump_jsonl(sessions: Iterable[SessionTrace], path: Path) -> None:
    with path.open("w") as out:
        for session in sessions:
            out.write(json.dumps(_session_json(session), separators=(",", ":")) + "\n")


def load_jsonl(path: Path) -> list[SessionTrace]:
    with path.open() as lines:
        return [_session_from(json.loads(line)) for line in lines if line.strip()]
