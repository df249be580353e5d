"""How much work a worker may take on now: a pure function of the engine's reading and of the
calls the worker already holds. No I/O; the clock is passed in.

Accounting, per worker:

- *committed*: the predicted peak of the calls the engine runs: the most KV tokens they will
  hold at one time if every one of them runs to its full ``max_tokens``. Each call holds its
  prompt and the tokens generated so far, and may add what is left of its budget; calls end
  at different times, so the peak is below the sum of their worst cases (LightLLM's
  "past-future" rule, arXiv 2507.10150: with calls sorted by what they have left, the peak is
  the largest, over k, of what the first k hold now plus k times what the k-th has left). As
  calls generate, what they hold grows exactly as what they have left shrinks, so the peak
  moves only when a call starts or ends. The engine's own KV usage is read too, and the
  larger of the two counts, so a reading the worker has not caught up with never makes room
  appear that is not there.
- *staged*: calls fetched from JetStream but not yet handed to the engine (they did not fit
  when they arrived). They are started in tier order as room frees.

Invariant: calls of the lower tiers start only while the committed peak stays at or under
``high_water * KV capacity`` (a single call larger than that runs only on an otherwise empty
engine), so for them the engine never has to preempt: vLLM reserves only what a sequence holds
and preempts when it runs out, kvgate starts a call only when the running set can finish
without that. Guaranteed calls may also take ``guaranteed_reserve`` of the cache above that
mark, so one arriving at a worker busy with lower tiers starts at once. Where the mark and the
reserve add up past the cache, the peak may exceed it; vLLM, which schedules by kvgate's
priority, then preempts the lowest-priority running call, never a guaranteed one for a lower
tier: its preemption is the safety valve, for the top tier only. The reserve thus costs the
lower tiers nothing while no guaranteed call needs it.

Rescue (on by default): a call that has waited ``rescue_after`` of its time-to-first-token
objective (the front door sends its tier's objective with it) and still does not fit may start
in an allowance of ``rescue_overcommit`` of the cache past what its tier may commit, with
vLLM's preemption as the safety valve. A call that waited that long would otherwise spend its
objective in the queue; the engine may instead have to preempt the lowest-priority running call
(the newest session's, lowest tier first) before the running set ends, which costs that call
time per output token, where the objectives leave more slack than in the first token. A due
call may start ahead of an earlier one that does not fit; a due call that does not fit even in
the allowance stops every later one, so due calls start first come, first served.

Over-commit (an operator's choice, off by default): a ``high_water`` above 1 lets the lower
tiers' predicted peak pass the cache too. The peak assumes every call runs to its whole
``max_tokens``, which agents' calls rarely do, so the engine may never reach it; where it does,
vLLM preempts the lowest-priority call (the newest session's, lowest tier first). Each
preemption the engine reports drops the mark to ``fallback_high_water`` (the worst-case-safe
mark), from which it climbs back over ``overcommit_recover_s``: a workload whose calls do use
their budgets soon runs at the safe mark (``high_water_after_preemption``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schemas.vocab import Tier
from workers.engine import EngineStats


@dataclass(frozen=True, slots=True)
class HeadroomPolicy:
    high_water: float = 0.95
    """Share of the KV cache the worker may commit to calls below the guaranteed tier."""
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
    """Share of the KV cache above ``high_water`` (and one sequence slot) that only guaranteed
    calls may use, so a guaranteed call arriving at a worker busy with lower tiers starts at
    once instead of waiting for a running call to finish (module doc: past the cache, vLLM
    preempts a lower tier's call for it)."""
    fallback_high_water: float = 0.95
    """Where the mark falls when the engine preempts, if ``high_water`` is above it (module
    doc: over-commit); it climbs back over ``overcommit_recover_s`` without preemptions."""
    overcommit_recover_s: float = 30.0
    rescue_after: float = 0.5
    """Share of its time-to-first-token objective a call waits (from its publish) before it
    may start in the rescue allowance (module doc)."""
    rescue_overcommit: float = 0.15
    """The rescue allowance: a share of the KV cache past what the call's tier may commit
    (0 turns rescue off)."""


def high_water_after_preemption(policy: HeadroomPolicy, since_preemption_s: float | None) -> float:
    """The mark in force ``since_preemption_s`` after the engine last preempted (``None``:
    never): ``fallback_high_water`` at once, back to ``high_water`` linearly over
    ``overcommit_recover_s`` (as SGLang's new-token ratio falls back after a retraction and
    decays again). A mark at or under the fallback is never raised."""
    top, low = policy.high_water, policy.fallback_high_water
    if since_preemption_s is None or top <= low:
        return top
    recovered = min(1.0, max(0.0, since_preemption_s) / max(policy.overcommit_recover_s, 1e-9))
    return low + (top - low) * recovered


@dataclass(frozen=True, slots=True)
class Headroom:
    tokens: int
    seqs: int
    reserved_tokens: int = 0
    """Of ``tokens``, how many only guaranteed calls may take."""
    reserved_seqs: int = 0
    rescue_tokens: int = 0
    """Past ``tokens``, what calls due for rescue may take (module doc)."""


@dataclass(frozen=True, slots=True)
class Load:
    """A call's KV tokens: what it holds now, and the most it may still add before it ends."""

    held: int
    remaining: int


@dataclass(frozen=True, slots=True)
class StagedCall:
    key: str
    tier: Tier
    cost: int
    """Worst case: KV tokens held once the whole budget is generated."""
    arrived_s: float
    remaining: int = 0
    """Of ``cost``, the output budget (held only as it is generated)."""
    session_started_ms: int = 0
    """When the call's session was admitted: within a tier, older sessions start first."""
    due_s: float | None = None
    """From when (``now_s``) the call may start in the rescue allowance; ``None``: never (it
    came with no time-to-first-token objective)."""

    @property
    def load(self) -> Load:
        return Load(self.cost - self.remaining, self.remaining)


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(max(0, tokens) / block_size) * block_size


def call_load(prompt_tokens: int, max_tokens: int, generated: int, block_size: int) -> Load:
    """What a call holds after ``generated`` output tokens and may still add, each rounded up
    to whole blocks: at any later point the call holds at most the sum of the two."""
    return Load(
        held=_blocks(prompt_tokens + generated, block_size),
        remaining=_blocks(max_tokens - generated, block_size),
    )


def predicted_peak(loads: Iterable[Load]) -> int:
    """The most KV tokens ``loads`` hold at one time from now on, if each runs to its whole
    budget and frees its tokens when it ends (the past-future rule, module doc)."""
    peak = held = 0
    for k, load in enumerate(sorted(loads, key=lambda x: x.remaining, reverse=True), 1):
        held += load.held
        peak = max(peak, held + k * load.remaining)
    return peak


def headroom(
    stats: EngineStats,
    *,
    committed_tokens: int,
    committed_seqs: int,
    policy: HeadroomPolicy,
    high_water: float | None = None,
) -> Headroom:
    """The room beside ``committed_tokens``; ``high_water`` overrides the policy's mark (the
    mark in force after a preemption, ``high_water_after_preemption``)."""
    mark = policy.high_water if high_water is None else high_water
    seqs = stats.max_num_seqs + policy.max_waiting - committed_seqs
    capacity = stats.kv_capacity_tokens
    reserved_seqs = 1 if policy.guaranteed_reserve > 0 else 0
    if capacity is None:
        # No KV size known (an engine that does not report one): only sequences bound us.
        return Headroom(tokens=1 << 62, seqs=seqs, reserved_seqs=reserved_seqs)
    observed = math.ceil((stats.kv_cache_usage or 0.0) * capacity)
    used = max(committed_tokens, observed)
    reserved = int(policy.guaranteed_reserve * capacity)
    return Headroom(
        tokens=int(mark * capacity) + reserved - used,
        seqs=seqs,
        reserved_tokens=reserved,
        reserved_seqs=reserved_seqs,
        rescue_tokens=int(policy.rescue_overcommit * capacity),
    )


def start_order(
    staged: Sequence[StagedCall], now_s: float, starvation_s: float
) -> list[StagedCall]:
    """Calls starved past the bound first (oldest first), then by tier, then by their
    session's admission (an old session's next turn before a new session's first), then by
    arrival."""

    def key(call: StagedCall) -> tuple[int, int, int, float]:
        starved = now_s - call.arrived_s > starvation_s
        if starved:
            return (0, 0, 0, call.arrived_s)
        return (1, call.tier.priority, call.session_started_ms, call.arrived_s)

    return sorted(staged, key=key)


_SESSION_MS_BITS = 42  # unix milliseconds fit until the year 2109


def engine_priority(tier: Tier, session_started_ms: int) -> int:
    """vLLM's request priority (lower runs first; vLLM breaks ties by arrival): the tier,
    then the session's admission time, so that inside the engine too an old session's next
    turn goes before a new session's first, which a session that is half served needs to
    finish (program-level first come, first served: Autellix, arXiv 2502.13965; Continuum,
    arXiv 2511.02230)."""
    return (tier.priority << _SESSION_MS_BITS) + min(
        max(session_started_ms, 0), (1 << _SESSION_MS_BITS) - 1
    )


def select_starts(
    staged: Sequence[StagedCall],
    room: Headroom,
    *,
    engine_idle: bool,
    now_s: float,
    policy: HeadroomPolicy,
    running: Sequence[Load] = (),
) -> list[tuple[StagedCall, bool]]:
    """Which staged calls to hand to the engine now, in order, each with whether it starts by
    the rescue rule (past a call that does not fit, or in the allowance). A call takes from
    ``room`` what it adds to the predicted peak of the ``running`` calls and those chosen
    before it.

    Stops starting calls in order at the first one that does not fit, rather than letting
    smaller, lower-priority calls jump it, which would starve large calls for ever; past it,
    only calls due for rescue start (module doc), until one of them does not fit either.
    """
    chosen: list[tuple[StagedCall, bool]] = []
    tokens, seqs = room.tokens, room.seqs
    loads = list(running)
    peak = predicted_peak(loads)
    blocked = False
    for call in start_order(staged, now_s, policy.starvation_s):
        guaranteed = call.tier is Tier.GUARANTEED
        usable_tokens = tokens if guaranteed else tokens - room.reserved_tokens
        usable_seqs = seqs if guaranteed else seqs - room.reserved_seqs
        if seqs <= 0:
            break
        with_call = [*loads, call.load]
        added = predicted_peak(with_call) - peak
        # On an idle engine the first call always starts: one larger than the whole budget
        # would otherwise never run.
        first_on_idle = engine_idle and not chosen
        fits = first_on_idle or (usable_seqs > 0 and added <= usable_tokens)
        rescued = False
        if blocked or not fits:
            due = call.due_s is not None and now_s >= call.due_s
            if not due:
                blocked = True
                continue
            if usable_seqs <= 0 or added > usable_tokens + room.rescue_tokens:
                break
            rescued = True
        chosen.append((call, rescued))
        loads, peak = with_call, peak + added
        tokens -= added
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
