"""How much work a worker may take on now: a pure function of the engine's reading and of the
calls the worker already holds. No I/O; the clock is passed in.

Accounting, per worker:

- *committed*: every call handed to the engine reserves its worst case, prompt tokens plus
  ``max_tokens``, rounded up to whole KV blocks, until it ends. The engine's own KV usage is
  read too, and the larger of the two counts, so a reading the worker has not caught up with
  (or an estimate that was short) never makes room appear that is not there.
- *staged*: calls fetched from JetStream but not yet handed to the engine (they did not fit
  when they arrived). They are started in tier order as room frees.

Invariant: committed tokens stay at or under ``high_water * KV capacity`` (a single call
larger than that runs only on an otherwise empty engine), so the engine never has to preempt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.vocab import Tier
from workers.engine import EngineStats


@dataclass(frozen=True, slots=True)
class HeadroomPolicy:
    high_water: float = 0.90
    """Share of the KV cache the worker may commit."""
    low_water: float = 0.05
    """Below this share of free KV cache, fetch nothing: a sliver of room only buys calls
    that then wait."""
    max_waiting: int = 0
    """Calls allowed beyond the engine's ``max_num_seqs`` (they queue inside the engine)."""
    starvation_s: float = 10.0
    """A lower tier waits at most this long behind higher ones before it is served first."""
    default_call_tokens: int = 512
    """Cost assumed for a call not yet seen, until the running estimate has data."""
    guaranteed_reserve: float = 0.15
    """Share of the KV cache (and one sequence slot) that only guaranteed calls may use, so a
    guaranteed call arriving at a worker busy with lower tiers starts at once instead of
    waiting for a running call to finish."""


@dataclass(frozen=True, slots=True)
class Headroom:
    tokens: int
    seqs: int
    reserved_tokens: int = 0
    """Of ``tokens``, how many only guaranteed calls may take."""
    reserved_seqs: int = 0


@dataclass(frozen=True, slots=True)
class StagedCall:
    key: str
    tier: Tier
    cost: int
    arrived_s: float


def call_cost(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Worst-case KV tokens of one call, in whole blocks."""
    return math.ceil((prompt_tokens + max_tokens) / block_size) * block_size


def headroom(
    stats: EngineStats,
    *,
    committed_tokens: int,
    committed_seqs: int,
    policy: HeadroomPolicy,
) -> Headroom:
    seqs = stats.max_num_seqs + policy.max_waiting - committed_seqs
    capacity = stats.kv_capacity_tokens
    reserved_seqs = 1 if policy.guaranteed_reserve > 0 else 0
    if capacity is None:
        # No KV size known (an engine that does not report one): only sequences bound us.
        return Headroom(tokens=1 << 62, seqs=seqs, reserved_seqs=reserved_seqs)
    observed = math.ceil((stats.kv_cache_usage or 0.0) * capacity)
    used = max(committed_tokens, observed)
    return Headroom(
        tokens=int(policy.high_water * capacity) - used,
        seqs=seqs,
        reserved_tokens=int(policy.guaranteed_reserve * capacity),
        reserved_seqs=reserved_seqs,
    )


def start_order(
    staged: Sequence[StagedCall], now_s: float, starvation_s: float
) -> list[StagedCall]:
    """Calls starved past the bound first (oldest first), then by tier, then by arrival."""

    def key(call: StagedCall) -> tuple[int, int, float]:
        starved = now_s - call.arrived_s > starvation_s
        return (0 if starved else 1, call.tier.priority, call.arrived_s)

    return sorted(staged, key=key)


def select_starts(
    staged: Sequence[StagedCall],
    room: Headroom,
    *,
    engine_idle: bool,
    now_s: float,
    policy: HeadroomPolicy,
) -> list[StagedCall]:
    """Which staged calls to hand to the engine now, in order.

    Stops at the first call that does not fit rather than letting smaller, lower-priority
    calls jump it, which would starve large calls for ever.
    """
    chosen: list[StagedCall] = []
    tokens, seqs = room.tokens, room.seqs
    for call in start_order(staged, now_s, policy.starvation_s):
        guaranteed = call.tier is Tier.GUARANTEED
        usable_tokens = tokens if guaranteed else tokens - room.reserved_tokens
        usable_seqs = seqs if guaranteed else seqs - room.reserved_seqs
        # On an idle engine the first call always starts: one larger than the whole budget
        # would otherwise never run.
        first_on_idle = engine_idle and not chosen
        if seqs <= 0 or (usable_seqs <= 0 and not first_on_idle):
            break
        if call.cost > usable_tokens and not first_on_idle:
            break
        chosen.append(call)
        tokens -= call.cost
        seqs -= 1
    return chosen


def fetchable_calls(
    room: Headroom,
    *,
    staged: Sequence[StagedCall],
    capacity_tokens: int | None,
    est_call_tokens: int,
    engine_idle: bool,
    policy: HeadroomPolicy,
) -> int:
    """How many calls of about ``est_call_tokens`` fit beside what is staged (open pull
    credit is the pull plan's to subtract).

    The estimate only sizes pull requests: a call that turns out larger waits staged instead
    of over-committing. An idle worker with nothing staged always has room for one call,
    however large the estimate, or it could never start again.
    """
    if engine_idle and not staged:
        return max(1, room.tokens // max(est_call_tokens, 1))
    tokens = room.tokens - sum(c.cost for c in staged)
    if capacity_tokens is not None and tokens < policy.low_water * capacity_tokens:
        return 0
    by_tokens = tokens // max(est_call_tokens, 1)
    by_seqs = room.seqs - len(staged)
    return max(0, min(by_tokens, by_seqs))
