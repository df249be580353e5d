"""Session admission: admit, defer or reject a whole agent session. Pure: no I/O, the clock and
the jitter are arguments, so a decision takes microseconds and a test needs no server.

What a session reserves is its peak KV footprint, ``max_parallel * (est_prompt + est_output)``
tokens, against the fleet's live KV capacity times an over-commit factor per nested tier group (the
operator's static ``kv_overcommit`` as the floor; above it, what ``broker.admission.objectives``
learned that admitted work can carry while meeting its objectives). Checks, in order:

1. the tenant's quotas (concurrent sessions, parallel calls, tokens per minute) → 429;
2. live workers: none fresh → ``no_workers``; all draining → ``draining`` (defer);
3. a session bigger than its tier may ever hold, even with only ``min_parallel`` calls in
   flight → ``exceeds_capacity`` (reject);
4. the session cannot finish by its deadline (divided by ``deadline_margin``) even if it
   started now at the fastest decode speed per sequence the fleet currently shows, or at the
   pace that recently admitted sessions actually kept (slower: it includes their waits) →
   ``deadline_infeasible`` (reject);
5. fleet pressure (hysteresis, below) shuts out lower tiers first → ``fleet_saturated``;
   calls already queued for room that the session's calls would queue behind (staged at a
   worker, waiting in an engine, pending in JetStream) → ``fleet_saturated`` (defer): each
   such call means the fleet is full now, and a call that queues starts with its TTFT
   objective already spent on waiting;
6. the nested tier shares (see ``broker.admission.tenants``) → ``tier_capacity``; then the fleet
   total → ``fleet_saturated`` (defer);
7. the session's first turn (every granted call at once) does not fit in the KV the workers
   have not committed, less what sessions admitted since their last readings will commit →
   ``fleet_saturated`` (defer): its calls would be staged at a worker and start late. 6 bounds
   what admitted sessions may hold over their lives (most of it idle at any moment, which the
   windows learn); 7 is what the fleet can start now.

Shaping before refusing (as Sluice lowers ``max_tokens`` before it rejects): a session that does
not fit as declared in 3 or 6 is admitted with fewer calls in flight, as many as fit, if that is
at least its ``min_parallel`` and enough to finish by its deadline; its other calls wait inside
the session for one of its own slots.

The state store re-checks 1 and 6 atomically when it reserves (``broker.admission.state``), so
replicas racing on the same snapshot cannot over-admit; this function is the fast, explainable
first answer. A reading older than ``max_age_s`` is no capacity, never an idle worker.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.admission.tenants import Tenant, TierPolicy
from schemas.vocab import TIERS_BY_PRIORITY, Decision, Reason, Tier

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class WorkerReading:
    worker_id: str
    kv_usage: float | None
    kv_capacity_tokens: int | None
    running: int
    waiting: int
    max_num_seqs: int
    seq_tokens_per_s: float | None
    """Fastest recent decode speed of one sequence on this worker (``FleetView``)."""
    age_s: float
    draining: bool = False
    committed_tokens: int | None = None
    """Worst-case KV tokens of the calls the engine holds (``None`` from an older worker)."""
    staged: int = 0
    """Calls the worker fetched and holds back until they fit."""


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    workers: tuple[WorkerReading, ...]
    pending_by_tier: Mapping[Tier, int] | None
    """JetStream consumer backlog per tier; ``None`` when the lag could not be read."""
    unseen_tokens: int = 0
    """Reserved by sessions admitted (here) too recently for the readings to show their calls:
    what they will commit is counted as if they had committed all of it."""


@dataclass(frozen=True, slots=True)
class Holdings:
    """Reservations currently held, as the state store reports them."""

    reserved_by_tier: Mapping[Tier, int]
    tenant_sessions: int
    tenant_parallel: int
    tenant_tokens_this_minute: int
    released_tokens_per_s: float
    """How fast reservations were released over the last minute (for ``Retry-After``)."""
    seconds_to_next_minute: float = 60.0


@dataclass(frozen=True, slots=True)
class SessionNeed:
    tier: Tier
    max_parallel: int
    expected_calls: int
    est_prompt_tokens: int
    est_output_tokens: int
    deadline_s: float
    min_parallel: int = 1
    """The fewest calls in flight the session accepts being admitted with."""
    may_queue: bool = False
    """A plain call (a one-call session): it may wait in the queue (JetStream, the worker's
    staging), bounded by its own deadline, rather than be deferred for a queue or a first turn
    the workers cannot start now (checks 5 and 7). Its client asked for one answer, not for a
    promise about a whole session."""

    @property
    def call_tokens(self) -> int:
        return self.est_prompt_tokens + self.est_output_tokens

    @property
    def reserve_tokens(self) -> int:
        return self.max_parallel * self.call_tokens

    @property
    def total_tokens(self) -> int:
        return self.expected_calls * self.call_tokens


class Pressure(enum.IntEnum):
    NORMAL = 0
    ELEVATED = 1
    """Best-effort sessions wait."""
    SATURATED = 2
    """Only guaranteed sessions are admitted."""


@dataclass(frozen=True, slots=True)
class PressureBands:
    elevate_at: float = 0.85
    saturate_at: float = 1.0
    # Recovery bands sit below the escalation bands, so a load hovering at a threshold cannot
    # flip the state back and forth.
    recover_elevated_below: float = 0.70
    recover_saturated_below: float = 0.85
    confirm_readings: int = 3


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    tiers: Mapping[Tier, TierPolicy]
    kv_overcommit: float = 1.0
    bands: PressureBands = field(default_factory=PressureBands)
    default_retry_after_s: float = 5.0
    deadline_margin: float = 1.0
    """A session must be able to finish within its deadline divided by this, at the fastest
    speed the fleet shows (1: only what cannot finish even at best is rejected)."""


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    decision: Decision
    reason: Reason
    retry_after_s: int | None
    reserve_tokens: int
    tier_limits: tuple[int, ...]
    """Token ceiling of each nested tier group, highest tier first (what the store enforces)."""
    signals: Mapping[str, float | int | str | None]
    granted_parallel: int = 0
    """Calls the session may have in flight: ``max_parallel``, or fewer where it was shaped
    to fit (0 unless admitted)."""
    bound_group: int | None = None
    """The nested tier group whose room deferred the session, or shaped it to fewer calls
    than it could otherwise have (0 the whole fleet)."""

    @property
    def admitted(self) -> bool:
        return self.decision is Decision.ADMIT


def _serving(fleet: FleetSnapshot, max_age_s: float) -> list[WorkerReading]:
    """Workers with a fresh reading that are not draining: the ones whose capacity counts."""
    return [w for w in fleet.workers if w.age_s <= max_age_s and not w.draining]


def fleet_load(fleet: FleetSnapshot, max_age_s: float) -> float | None:
    """One number for "how full is the fleet": the larger of its capacity-weighted KV usage and
    its queue backlog in units of two full batches. ``None`` with no fresh reading."""
    live = _serving(fleet, max_age_s)
    if not live:
        return None
    capacity = sum(w.kv_capacity_tokens or 0 for w in live)
    if capacity > 0:
        used = sum((w.kv_usage or 0.0) * (w.kv_capacity_tokens or 0) for w in live)
        kv = used / capacity
    else:
        kv = max((w.kv_usage or 0.0) for w in live)
    slots = sum(w.max_num_seqs for w in live)
    queued = sum(w.waiting for w in live)
    if fleet.pending_by_tier is not None:
        queued += sum(fleet.pending_by_tier.values())
    backlog = queued / (2 * slots) if slots else 0.0
    return max(kv, backlog)


def queued_ahead(fleet: FleetSnapshot, tier: Tier, max_age_s: float) -> int:
    """Calls waiting for room that a new call of ``tier`` would queue behind: those pending in
    JetStream in its tier or a higher one and, below the guaranteed tier, those a worker staged
    or its engine keeps waiting (a worker starts guaranteed calls first, from a reserve of
    their own, so at a worker they queue behind nobody). An unread lag counts no pending
    calls: the pressure bands already treat a backlog, and an outage of the lag reader must not
    close admission."""
    index = TIERS_BY_PRIORITY.index(tier)
    queued = 0
    if fleet.pending_by_tier is not None:
        queued += sum(fleet.pending_by_tier.get(t, 0) for t in TIERS_BY_PRIORITY[: index + 1])
    if tier is not Tier.GUARANTEED:
        queued += sum(w.staged + w.waiting for w in _serving(fleet, max_age_s))
    return queued


def _held_tokens(w: WorkerReading) -> int:
    """The KV a worker has committed: the predicted peak of what it runs, or what the engine
    holds where that is more (a used block counts whole)."""
    used = math.ceil((w.kv_usage or 0.0) * (w.kv_capacity_tokens or 0))
    return max(w.committed_tokens or 0, used)


def uncommitted_tokens(fleet: FleetSnapshot, max_age_s: float) -> int:
    """KV tokens the serving workers have not committed (``_held_tokens``), less
    ``fleet.unseen_tokens``; at most the fleet's capacity, possibly negative."""
    free = 0
    for w in _serving(fleet, max_age_s):
        free += (w.kv_capacity_tokens or 0) - _held_tokens(w)
    return free - fleet.unseen_tokens


def fleet_busy(fleet: FleetSnapshot, max_age_s: float) -> float | None:
    """The share of the serving workers' KV that they have committed (``_held_tokens``);
    ``None`` with no fresh reading of a cache's size."""
    live = _serving(fleet, max_age_s)
    capacity = sum(w.kv_capacity_tokens or 0 for w in live)
    if capacity <= 0:
        return None
    return sum(_held_tokens(w) for w in live) / capacity


def fleet_has_room(fleet: FleetSnapshot, max_age_s: float, below: float) -> bool:
    """Whether the fleet measurably has room for more work: fresh readings from serving workers,
    KV committed (the workers' predicted peak of what they run) and KV in use both under
    ``below`` of capacity, and nothing staged at a worker, waiting in an engine or pending in
    JetStream. Unknown is never room: no fresh reading, or the lag unread, is ``False``."""
    busy = fleet_busy(fleet, max_age_s)
    if busy is None or fleet.pending_by_tier is None:
        return False
    return not queued_ahead(fleet, TIERS_BY_PRIORITY[-1], max_age_s) and busy < below


class PressureTracker:
    """Pressure state with hysteresis: a change is confirmed over ``confirm_readings``
    consecutive readings, escalation and recovery use different bands, and it moves one level
    at a time. A missing reading (no live worker) leaves the state as it is."""

    def __init__(self, bands: PressureBands | None = None) -> None:
        self.bands = bands or PressureBands()
        self.state = Pressure.NORMAL
        self._streak = 0
        self._toward: Pressure | None = None

    def _target(self, load: float) -> Pressure:
        b = self.bands
        if self.state is Pressure.NORMAL:
            return Pressure.ELEVATED if load >= b.elevate_at else Pressure.NORMAL
        if self.state is Pressure.ELEVATED:
            if load >= b.saturate_at:
                return Pressure.SATURATED
            return Pressure.NORMAL if load < b.recover_elevated_below else Pressure.ELEVATED
        return Pressure.ELEVATED if load < b.recover_saturated_below else Pressure.SATURATED

    def observe(self, load: float | None) -> Pressure:
        if load is None:
            return self.state
        target = self._target(load)
        if target is self.state:
            self._streak, self._toward = 0, None
            return self.state
        if target is not self._toward:
            self._streak, self._toward = 0, target
        self._streak += 1
        if self._streak >= self.bands.confirm_readings:
            self.state, self._streak, self._toward = target, 0, None
        return self.state


def tier_limits(
    policy: AdmissionPolicy, physical_tokens: int, factors: Sequence[float] | None = None
) -> tuple[int, ...]:
    """The token ceiling of each nested group (a tier and all tiers below it), highest tier
    first: the group's share of the physical KV capacity times the group's over-commit factor
    (``policy.kv_overcommit`` for every group when ``factors`` is ``None``)."""
    return tuple(
        int(
            policy.tiers[t].share
            * physical_tokens
            * (policy.kv_overcommit if factors is None else factors[i])
        )
        for i, t in enumerate(TIERS_BY_PRIORITY)
    )


def group_reserved(reserved_by_tier: Mapping[Tier, int]) -> tuple[int, ...]:
    """Tokens held by each nested group, highest tier first."""
    held = [reserved_by_tier.get(t, 0) for t in TIERS_BY_PRIORITY]
    return tuple(sum(held[i:]) for i in range(len(held)))


def most_parallel(call_tokens: int, room: Sequence[int]) -> int:
    """The most calls of ``call_tokens`` that fit in every one of ``room``."""
    return max(0, min(r // call_tokens for r in room)) if call_tokens > 0 else 0


def decide(
    need: SessionNeed,
    tenant: Tenant,
    fleet: FleetSnapshot,
    holdings: Holdings,
    pressure: Pressure,
    policy: AdmissionPolicy,
    *,
    max_age_s: float,
    jitter: float,
    factors: Sequence[float] | None = None,
    session_pace_s: float | None = None,
    fleet_busy: float | None = None,
) -> AdmissionDecision:
    """``jitter`` in [0, 1) spreads retries: ``Retry-After`` estimates are scaled by 0.8 to 1.2.
    ``session_pace_s``: how long admitted sessions took per output token of a round of calls
    (``broker.admission.objectives.SessionPace``), for check 4. ``factors``, one per nested tier
    group (``broker.admission.objectives`` learns them from the objectives admitted calls met),
    replace the policy's static over-commit for what may be reserved now, and never go below
    it; whether a session could *ever* fit is judged by the static one, so that a rejection does
    not depend on the moment it was asked.

    A session that does not fit with ``max_parallel`` calls in flight is granted fewer, down to
    ``min_parallel`` and to the fewest with which it can still finish by its deadline
    (``AdmissionDecision.granted_parallel``), and to no more calls than the serving workers'
    caches could ever start at once; only below that is it deferred or rejected."""
    live = [w for w in fleet.workers if w.age_s <= max_age_s]
    serving = [w for w in live if not w.draining]
    physical = sum(w.kv_capacity_tokens or 0 for w in serving)
    if factors is not None:
        factors = [max(f, policy.kv_overcommit) for f in factors]
    limits = tier_limits(policy, physical, factors)
    ceilings = tier_limits(policy, physical)
    groups = group_reserved(holdings.reserved_by_tier)
    reserved = groups[0]
    signals: dict[str, float | int | str | None] = {
        "workers_live": len(live),
        "workers_stale": len(fleet.workers) - len(live),
        "capacity_tokens": limits[0],
        "overcommit": round(policy.kv_overcommit if factors is None else factors[0], 3),
        "reserved_tokens": reserved,
        "need_tokens": need.reserve_tokens,
        "pressure": pressure.name.lower(),
        "pending": None if fleet.pending_by_tier is None else sum(fleet.pending_by_tier.values()),
        "tenant_sessions": holdings.tenant_sessions,
        "release_tokens_per_s": round(holdings.released_tokens_per_s, 3),
    }
    if fleet_busy is not None:  # how busy the caller read the fleet (the pace depends on it)
        signals["fleet_busy"] = round(fleet_busy, 3)

    def answer(
        decision: Decision,
        reason: Reason,
        wait_s: float | None = None,
        *,
        granted: int = 0,
        bound_group: int | None = None,
    ) -> AdmissionDecision:
        retry = None if wait_s is None else _retry_after(wait_s, jitter)
        return AdmissionDecision(
            decision,
            reason,
            retry,
            granted * need.call_tokens if granted else need.reserve_tokens,
            limits,
            signals,
            granted_parallel=granted,
            bound_group=bound_group,
        )

    def wait_for(shortfall: int) -> float:
        return _wait_s(shortfall, holdings.released_tokens_per_s, policy.default_retry_after_s)

    # 1. The tenant's own quotas: retrying helps only once the tenant's own work ends.
    if holdings.tenant_sessions + 1 > tenant.max_sessions:
        return answer(Decision.REJECT, Reason.TENANT_QUOTA, policy.default_retry_after_s)
    if holdings.tenant_parallel + need.min_parallel > tenant.max_parallel_calls:
        return answer(Decision.REJECT, Reason.TENANT_QUOTA, policy.default_retry_after_s)
    if holdings.tenant_tokens_this_minute + need.total_tokens > tenant.tokens_per_minute:
        return answer(Decision.REJECT, Reason.TENANT_QUOTA, holdings.seconds_to_next_minute)
    quota_parallel = tenant.max_parallel_calls - holdings.tenant_parallel

    # 2. Live capacity. Stale readings were dropped above: unknown is never idle.
    if not live:
        return answer(Decision.DEFER, Reason.NO_WORKERS, policy.default_retry_after_s)
    if not serving:
        return answer(Decision.DEFER, Reason.DRAINING, policy.default_retry_after_s)

    # 3. Bigger than the tier could ever hold on this fleet, even shaped to its minimum.
    index = TIERS_BY_PRIORITY.index(need.tier)
    signals["group_factor"] = round(policy.kv_overcommit if factors is None else factors[index], 3)
    ever = most_parallel(need.call_tokens, ceilings[: index + 1])
    if ever < need.min_parallel:
        return answer(Decision.REJECT, Reason.EXCEEDS_CAPACITY, MAX_RETRY_AFTER_S)
    widest = min(need.max_parallel, ever, quota_parallel)

    # 4. Too slow to finish by its deadline even if it started now with as many calls in
    # flight as it may ever have, at the fastest speed per sequence the fleet shows. With no
    # speed observed yet, nothing is rejected on a guess.
    fewest = need.min_parallel
    observed = [w.seq_tokens_per_s for w in serving if w.seq_tokens_per_s]
    # One call's decode at the fastest speed per sequence the fleet shows, if it shows one.
    decode_s = need.est_output_tokens / max(observed) if observed else None
    # A queue, or a first turn that does not fit in the KV not committed now (checks 5 and 7),
    # ends as calls in flight end: asked back after one call's time, not after the default
    # meant for a fleet reserved full. A session asked back after 5 s had spent most of its
    # slack on it (`loadtests/results/held-turns`).
    calls_end_s = policy.default_retry_after_s if decode_s is None else decode_s
    # The learned pace (seconds per output token of a round, everything a session waits for
    # included) where there is one, never faster than the fastest decode the fleet shows. A
    # plain call waits for no tool: its own speed is its bound.
    pace_s = None if need.may_queue else session_pace_s
    if decode_s is not None or pace_s is not None:
        call_s = decode_s or 0.0
        if pace_s is not None:
            signals["session_pace_ms"] = round(pace_s * 1000, 3)
            call_s = max(call_s, need.est_output_tokens * pace_s)
        fastest_s = math.ceil(need.expected_calls / widest) * call_s
        signals["fastest_finish_s"] = round(fastest_s, 3)
        budget_s = need.deadline_s / policy.deadline_margin
        if fastest_s > budget_s:
            return answer(Decision.REJECT, Reason.DEADLINE_INFEASIBLE)
        rounds = max(1, int(budget_s // call_s)) if call_s > 0 else need.expected_calls
        fewest = max(fewest, math.ceil(need.expected_calls / rounds))

    # 5. Pressure from the live signals closes lower tiers first.
    if (pressure is Pressure.SATURATED and need.tier is not Tier.GUARANTEED) or (
        pressure is Pressure.ELEVATED and need.tier is Tier.BESTEFFORT
    ):
        return answer(Decision.DEFER, Reason.FLEET_SATURATED, policy.default_retry_after_s)

    queued = 0 if need.may_queue else queued_ahead(fleet, need.tier, max_age_s)
    signals["queued_ahead"] = queued
    if queued:
        return answer(Decision.DEFER, Reason.FLEET_SATURATED, calls_end_s)

    # 6. Room in every nested group the session's tier belongs to, for as many calls as fit.
    room = [limits[i] - groups[i] for i in range(index + 1)]
    fit = [most_parallel(need.call_tokens, [r]) for r in room]
    granted = min(widest, *fit)
    if granted >= fewest:
        # Shaped by the room left now (not by the session's size): the narrowest group bound.
        narrowest = fit.index(min(fit)) if granted < widest else None
        # 7. What the fleet can start now. Not a bound of the windows: it says nothing about
        # how much of their reservations admitted sessions use over their lives. A first turn
        # larger than the serving workers' caches together could never start at once, so a
        # session that accepts fewer calls is shaped to what they hold (over-committed windows
        # would otherwise let it wait for ever on an idle fleet); one that could start but
        # cannot now is deferred, not shaped for its whole life by a passing moment.
        free = uncommitted_tokens(fleet, max_age_s)
        signals["uncommitted_tokens"] = free
        if not need.may_queue:
            ever_at_once = most_parallel(need.call_tokens, [physical])
            if fewest <= ever_at_once < granted:
                granted = ever_at_once
            if granted * need.call_tokens > free:
                return answer(Decision.DEFER, Reason.FLEET_SATURATED, calls_end_s)
        if granted < need.max_parallel:
            signals["granted_parallel"] = granted
        return answer(Decision.ADMIT, Reason.ADMITTED, granted=granted, bound_group=narrowest)
    want = fewest * need.call_tokens
    for i in range(index, -1, -1):
        if groups[i] + want > limits[i]:
            return answer(
                Decision.DEFER,
                Reason.TIER_CAPACITY if i else Reason.FLEET_SATURATED,
                wait_for(groups[i] + want - limits[i]),
                bound_group=i,
            )
    raise AssertionError("a session that fits at its fewest calls was not admitted")


def _retry_after(wait_s: float, jitter: float) -> int:
    scaled = wait_s * (0.8 + 0.4 * jitter)
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(scaled)))


def retry_after_for_shortfall(
    shortfall_tokens: int, released_tokens_per_s: float, default_s: float, jitter: float
) -> int:
    """``Retry-After`` for a reservation the store refused (a replica won the race)."""
    return _retry_after(_wait_s(shortfall_tokens, released_tokens_per_s, default_s), jitter)


def _wait_s(shortfall_tokens: int, released_tokens_per_s: float, default_s: float) -> float:
    """How long until ``shortfall_tokens`` are released at the recent release rate."""
    if released_tokens_per_s > 0:
        return shortfall_tokens / released_tokens_per_s
    return default_s
