"""The I/O shell around the admission policy: read the signals, decide, reserve, record.

A decision reads the fleet (``FleetSignals``: the workers' readings and the queue lag, both kept
current in the background) and the holdings from the admission state (one Redis round trip); it
calls the pure ``broker.admission.policy.decide``; an admit then reserves atomically in the state
store, which may still refuse if another replica took the room first. Every answer, whichever way it
went, goes to the ledger and the metrics.

A session that is deferred for want of room (``tier_capacity``, ``fleet_saturated``) may be
held, up to its ``max_wait_s``, and decided again each time room may have freed: at once when
a session ends on this replica, otherwise every ``HOLD_POLL_S`` (another replica's release, or
a worker's new reading, is seen at the next pass). Its deadline shrinks by the time held, so a
session that can no longer finish is rejected rather than admitted late. A held session is
answered as soon as it fits, not at the next ``Retry-After`` a client would round up to whole
seconds, and a client that retries at once without waiting spends its retries in milliseconds:
holding serves both. Held sessions are decided again in turns, a higher tier first, then the
earliest deadline, and a new session does not go before them (``broker.admission.holding``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass, replace

from opentelemetry.trace import Span

from broker.admission.holding import HeldSessions
from broker.admission.metrics import AdmissionMetrics
from broker.admission.objectives import (
    FleetBusy,
    ObjectiveWindows,
    SessionPace,
    Verdict,
    WindowBounds,
)
from broker.admission.policy import (
    AdmissionDecision,
    AdmissionPolicy,
    FleetSnapshot,
    PressureTracker,
    SessionNeed,
    decide,
    fleet_busy,
    fleet_has_room,
    fleet_load,
    retry_after_for_shortfall,
)
from broker.admission.signals import FleetSignals
from broker.admission.state import (
    AdmissionState,
    MemoryAdmissionState,
    ReserveRequest,
    SessionRecord,
    TenantLimits,
)
from broker.admission.tenants import Tenancy, Tenant
from broker.db import utcnow
from broker.errors import AdmissionUnavailable, Refused, error_class
from broker.ledger import Ledger, LedgerEntry
from broker.settings import ApiSettings
from broker.telemetry import tracer
from schemas.vocab import Decision, Reason, SessionState, Tier

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.25
"""How often a held session is decided again with no release seen here (each time one read of
the shared state): a release on another replica, or a worker's reading, is seen this late."""
UNSEEN_MARGIN_MS = 250
"""A session admitted this long before a worker's reading may not have started its calls when
the reading was taken: its reservation still counts as unseen (counting twice errs safe)."""
ACTIVE_SESSIONS_READ_S = 5.0
"""How often the live sessions per tier and tenant are read for the metrics and the dashboard
(one Redis round trip; they are not on any decision's path)."""
HEAL_INTERVAL_S = 60.0
"""How often the shared state's totals are recomputed from its leases (``AdmissionState.heal``):
an O(leases) script, cheap once a minute, and a drift is never older than this."""
HELD_REASONS = frozenset({Reason.TIER_CAPACITY, Reason.FLEET_SATURATED})
"""Deferrals for want of room, which a short wait can end; the others (no workers, draining,
shared state unreachable) are answered at once."""

_MESSAGES: dict[Reason, str] = {
    Reason.TENANT_QUOTA: "the tenant is over its quota (sessions, parallel calls or tokens "
    "per minute)",
    Reason.TIER_CAPACITY: "the tier's share of the fleet is fully reserved",
    Reason.FLEET_SATURATED: "the fleet is fully reserved or under pressure",
    Reason.DEADLINE_INFEASIBLE: "the session cannot finish by its deadline even on an idle fleet",
    Reason.EXCEEDS_CAPACITY: "the session needs more KV cache than its tier may ever hold on "
    "this fleet",
    Reason.NO_WORKERS: "no live worker (none, or none with a fresh heartbeat)",
    Reason.DRAINING: "every live worker is draining",
    Reason.ADMISSION_UNAVAILABLE: "the shared admission state (Redis) is unreachable",
}


@dataclass(frozen=True, slots=True)
class Admitted:
    record: SessionRecord
    existing: bool
    degraded: bool


class RecentAdmissions:
    """This replica's recent admissions still held, in admission order: session id →
    (admitted at, unix ms; reserved tokens), with their total kept as they come and go (it is
    read on every decision). A released session commits nothing more."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, int]] = {}
        self._tokens = 0

    def add(self, session_id: str, at_ms: int, tokens: int) -> None:
        self.drop(session_id)
        self._entries[session_id] = (at_ms, tokens)
        self._tokens += tokens

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._tokens -= entry[1]

    def tokens_since(self, since_ms: int) -> int:
        """Forget the entries admitted before ``since_ms``; the tokens of those left."""
        entries = self._entries
        while entries:
            first = next(iter(entries))
            at_ms, tokens = entries[first]
            if at_ms >= since_ms:
                break
            del entries[first]
            self._tokens -= tokens
        return self._tokens


class Admitter:
    def __init__(
        self,
        settings: ApiSettings,
        tenancy: Tenancy,
        state: AdmissionState,
        signals: FleetSignals,
        metrics: AdmissionMetrics,
        ledger: Ledger | None,
        *,
        shared: bool,
    ) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.state = state
        self.shared = shared
        # While Redis is unreachable, tiers in `degraded_tiers` are admitted against this
        # replica's own budget; those sessions live here until they end.
        self.fallback = (
            MemoryAdmissionState(retention_ms=int(settings.session_retention_s * 1000))
            if shared
            else None
        )
        self.signals = signals
        self.metrics = metrics
        self.ledger = ledger
        self.replica = settings.replica_id or uuid.uuid4().hex[:12]
        self.policy = AdmissionPolicy(
            tiers=tenancy.tiers,
            kv_overcommit=settings.admission_kv_overcommit,
            deadline_margin=settings.admission_deadline_margin,
        )
        self.pressure = PressureTracker(self.policy.bands)
        self.windows = ObjectiveWindows(
            WindowBounds(
                floor=settings.admission_kv_overcommit,
                ceiling=max(settings.admission_kv_overcommit, settings.admission_kv_overcommit_max),
                target=settings.admission_objective_target,
                min_missed=settings.admission_objective_min_missed,
            )
        )
        q = settings.admission_pace_quantile
        self.pace = SessionPace(q) if q > 0 else None
        self.busy = FleetBusy()
        """How busy the fleet is, now and over each session's life: the pace is learned and
        read by it (``SessionPace.at``)."""
        self._rng = random.Random()
        self.held = HeldSessions(HOLD_POLL_S)
        self.metrics.held_now.set_function(lambda: self.held.held)
        self._admitted_recently = RecentAdmissions()
        self._task: asyncio.Task[None] | None = None
        self._state_reachable = True
        self._healed_ms = 0
        self._counted_ms = 0
        self.active_sessions: dict[tuple[Tier, str], int] = {}
        """Live sessions per tier and tenant, fleet-wide, as last read (``_tick``)."""

    # -- background: pressure readings and lease expiry ---------------------------------

    def start(self, interval_s: float = 0.5) -> None:
        self._task = asyncio.create_task(self._tick(interval_s))

    async def stop(self) -> None:
        await self.held.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _tick(self, interval_s: float) -> None:
        """Every ``interval_s``: pressure, windows, pace, lease expiry. An unexpected error
        in one step is logged and the next step runs: a tick that died would leave pressure,
        the windows and expiry frozen at their last values with nothing said."""
        failing: str | None = None
        while True:
            try:
                await self._step()
                failing = None
            except Exception as exc:
                if repr(exc) != failing:  # once per distinct error, not twice a second
                    log.exception("admission's background step failed; it goes on")
                failing = repr(exc)
            await asyncio.sleep(interval_s)

    async def _step(self) -> None:
        """One background step (``_tick``)."""
        now_ms = int(time.time() * 1000)
        snapshot = self.signals.snapshot(now_ms)
        self.pressure.observe(fleet_load(snapshot, self.signals.max_age_s))
        self.metrics.pressure.set(int(self.pressure.state))
        if self.fallback is not None:
            await self.fallback.sweep(now_ms)
        self._learn_windows(now_ms, snapshot)
        self.busy.step(now_ms / 1000, fleet_busy(snapshot, self.signals.max_age_s))
        if self.pace is not None:
            now_s = now_ms / 1000
            self.pace.refresh(now_s, lambda session_id: self.busy.so_far(session_id, now_s))
        try:
            await self.state.sweep(now_ms)
            if now_ms - self._counted_ms >= ACTIVE_SESSIONS_READ_S * 1000:
                self._counted_ms = now_ms
                self.active_sessions = await self.state.active_sessions()
                self.metrics.set_active_sessions(self.active_sessions)
            if now_ms - self._healed_ms >= HEAL_INTERVAL_S * 1000:
                self._healed_ms = now_ms
                wrong = await self.state.heal(now_ms)
                if wrong:
                    log.warning("admission state: %d entries were wrong and were mended", wrong)
                    self.metrics.healed.inc(wrong)
            if not self._state_reachable:
                log.info("admission state reachable again")
            self._state_reachable = True
        except AdmissionUnavailable as exc:
            if self._state_reachable:  # once per outage, not twice a second
                log.error("%s; degraded tiers: %s", exc, self.settings.degraded_tiers)
            self._state_reachable = False

    def _learn_windows(self, now_ms: int, snapshot: FleetSnapshot) -> None:
        room = fleet_has_room(snapshot, self.signals.max_age_s, self.windows.bounds.room_below)
        windows = self.windows.step(now_ms / 1000, room=room)
        for tier, window in windows.items():
            self.metrics.window.labels(tier.value).set(window)
        self.metrics.overcommit.set(self.windows.group_factors()[0])

    def judge_call(self, verdict: Verdict) -> None:
        """A call of an admitted session, judged against its objectives."""
        self.windows.judge(verdict, time.time())

    def _unseen_tokens(self, snapshot: FleetSnapshot, now_ms: int) -> int:
        """Tokens reserved by this replica's admissions that the newest worker reading in
        ``snapshot`` (taken at ``now_ms``) cannot show yet. Another replica's recent
        admissions are not known here: with several replicas, a burst is bounded by the
        reservations and the workers' own headroom."""
        fresh = [w.age_s for w in snapshot.workers]
        newest_ms = now_ms - int(min(fresh, default=0.0) * 1000)
        # Entries the fleet has surely seen are dropped; none older than a reading lingers.
        return self._admitted_recently.tokens_since(newest_ms - UNSEEN_MARGIN_MS)

    # -- sessions ---------------------------------------------------------------------------

    async def admit(
        self,
        tenant: Tenant,
        need: SessionNeed,
        *,
        scope: str,
        idle_timeout_s: float,
        metadata: dict[str, object] | None = None,
        idempotency_key: str | None = None,
        max_wait_s: float = 0.0,
    ) -> Admitted:
        """Admit a session or raise ``Refused`` (or ``AdmissionUnavailable``). A session
        deferred for want of room is held up to ``max_wait_s`` (see the module docstring)."""
        with tracer().start_as_current_span("admission") as span:
            held_from = time.monotonic()
            rank = (need.tier.priority, held_from + need.deadline_s)
            place = None
            try:
                # Decided at once unless a session held here goes first (``HeldSessions``).
                decide_now = not self.held.ahead_of(rank)
                held_s = 0.0
                while True:
                    left_s = max_wait_s - held_s
                    if decide_now or left_s <= 0:
                        # Its deadline shrinks by the time held.
                        waited = (
                            replace(need, deadline_s=need.deadline_s - held_s) if held_s else need
                        )
                        admitted = await self._admit(
                            tenant,
                            waited,
                            scope,
                            idle_timeout_s,
                            metadata,
                            idempotency_key,
                            span,
                            held_s,
                            final=left_s <= 0,
                        )
                        if admitted is not None:
                            return admitted
                    if place is None:
                        place = self.held.join(rank)
                    else:
                        self.held.decided(place)
                    decide_now = await self.held.turn(place, left_s)
                    held_s = time.monotonic() - held_from
            finally:
                if place is not None:
                    self.held.leave(place)

    async def _admit(
        self,
        tenant: Tenant,
        need: SessionNeed,
        scope: str,
        idle_timeout_s: float,
        metadata: dict[str, object] | None,
        idempotency_key: str | None,
        span: Span,
        held_s: float,
        *,
        final: bool,
    ) -> Admitted | None:
        """One decision: admitted, or ``Refused`` raised. ``None`` is a deferral for want of
        room that is not ``final``: not answered nor recorded, the caller holds the session and
        asks again."""
        started = time.perf_counter()
        now_ms = int(time.time() * 1000)
        snapshot = self.signals.snapshot(now_ms)
        try:
            admitted, decision = await self._admit_on(
                self.state,
                tenant,
                need,
                snapshot,
                now_ms,
                1.0,
                idle_timeout_s,
                metadata,
                idempotency_key,
            )
            degraded = False
        except AdmissionUnavailable:
            if self.fallback is None or need.tier not in self.settings.degraded_tiers:
                decision = AdmissionDecision(
                    Decision.DEFER,
                    Reason.ADMISSION_UNAVAILABLE,
                    5,
                    need.reserve_tokens,
                    (),
                    {"state": "unreachable"},
                )
                admitted = None
            else:
                admitted, decision = await self._admit_on(
                    self.fallback,
                    tenant,
                    need,
                    snapshot,
                    now_ms,
                    self.settings.degraded_share,
                    idle_timeout_s,
                    metadata,
                    idempotency_key,
                )
                if admitted is not None:
                    decision = replace(decision, reason=Reason.ADMITTED_DEGRADED)
            degraded = True
        latency_s = time.perf_counter() - started
        if admitted is None and not final and decision.reason in HELD_REASONS:
            return None
        if held_s:
            decision = replace(decision, signals={**decision.signals, "held_s": round(held_s, 3)})
        self.metrics.held.labels(need.tier.value, decision.decision.value).observe(held_s)
        self._observe(tenant, need, decision, scope, admitted, latency_s)
        if span.is_recording():
            span.set_attributes(_span_attributes(tenant, need, decision, scope, admitted))
        if admitted is None:
            log.info(
                "%s %s session of tenant %s (%s): %s, retry after %s s",
                decision.decision.value,
                need.tier.value,
                tenant.id,
                scope,
                decision.reason.value,
                decision.retry_after_s,
            )
            raise error_class(decision.reason.error_code, Refused)(
                _MESSAGES[decision.reason],
                decision=decision.decision.value,
                retry_after=decision.retry_after_s,
            )
        return Admitted(admitted[0], admitted[1], degraded)

    async def _admit_on(
        self,
        state: AdmissionState,
        tenant: Tenant,
        need: SessionNeed,
        snapshot: FleetSnapshot,
        now_ms: int,
        share: float,
        idle_timeout_s: float,
        metadata: dict[str, object] | None,
        idempotency_key: str | None,
    ) -> tuple[tuple[SessionRecord, bool] | None, AdmissionDecision]:
        holdings = await state.holdings(tenant.id, now_ms)
        # Read after the await and recorded below before the next one, so that sessions
        # decided concurrently on this replica each see the others' admissions.
        snapshot = replace(snapshot, unseen_tokens=self._unseen_tokens(snapshot, now_ms))
        policy = self.policy
        if share < 1.0:
            policy = replace(policy, kv_overcommit=policy.kv_overcommit * share)
        jitter = self._rng.random()
        busy = self.busy.now(now_ms / 1000)
        decision = decide(
            need,
            tenant,
            snapshot,
            holdings,
            self.pressure.state,
            policy,
            max_age_s=self.signals.max_age_s,
            jitter=jitter,
            factors=[f * share for f in self.windows.group_factors()],
            session_pace_s=None if self.pace is None else self.pace.at(busy),
            fleet_busy=busy,
        )
        if decision.bound_group is not None:
            self.windows.bound(decision.bound_group)
        if not decision.admitted:
            return None, decision
        granted = decision.granted_parallel
        deadline_ms = now_ms + int(need.deadline_s * 1000)
        idle_ms = int(idle_timeout_s * 1000)
        record = SessionRecord(
            id=f"sess_{uuid.uuid4().hex}",
            tenant=tenant.id,
            tier=need.tier,
            state=SessionState.ACTIVE,
            max_parallel=granted,
            expected_calls=need.expected_calls,
            est_prompt_tokens=need.est_prompt_tokens,
            est_output_tokens=need.est_output_tokens,
            reserved_tokens=decision.reserve_tokens,
            created_ms=now_ms,
            deadline_ms=deadline_ms,
            idle_timeout_ms=idle_ms,
            expires_ms=min(deadline_ms, now_ms + idle_ms),
            metadata=dict(metadata or {}),
        )
        self._admitted_recently.add(record.id, int(time.time() * 1000), decision.reserve_tokens)
        outcome = await state.reserve(
            ReserveRequest(
                record=record,
                tier_limits=decision.tier_limits,
                tenant_limits=TenantLimits(
                    tenant.max_sessions,
                    tenant.max_parallel_calls,
                    tenant.tokens_per_minute,
                    tenant.max_reserved_tokens,
                ),
                tokens_charged=need.total_tokens,
                idempotency_key=idempotency_key,
            ),
            now_ms,
        )
        if outcome.record is not None and not outcome.existing:
            if self.pace is not None and not need.may_queue:  # a session, closed by its client
                self.busy.mark(record.id, now_ms / 1000)
                self.pace.opened(
                    record.id,
                    now_ms / 1000,
                    expected_calls=record.expected_calls,
                    max_parallel=record.max_parallel,
                    est_output_tokens=record.est_output_tokens,
                    deadline_s=need.deadline_s,
                )
            return (outcome.record, False), decision
        # An idempotent retry got its earlier session back, or the store refused: nothing new.
        self._admitted_recently.drop(record.id)
        if outcome.record is not None:
            return (outcome.record, True), decision
        # Another replica took the room between our snapshot and our reservation.
        kind = Decision.REJECT if outcome.reason is Reason.TENANT_QUOTA else Decision.DEFER
        retry = retry_after_for_shortfall(
            outcome.shortfall_tokens,
            holdings.released_tokens_per_s,
            policy.default_retry_after_s,
            jitter,
        )
        signals = {**decision.signals, "store_refused": outcome.reason.value}
        return None, replace(
            decision, decision=kind, reason=outcome.reason, retry_after_s=retry, signals=signals
        )

    def _observe(
        self,
        tenant: Tenant,
        need: SessionNeed,
        decision: AdmissionDecision,
        scope: str,
        admitted: tuple[SessionRecord, bool] | None,
        latency_s: float,
    ) -> None:
        tier = need.tier.value
        self.metrics.decisions.labels(tier, decision.decision.value, decision.reason.value).inc()
        self.metrics.latency.labels(scope).observe(latency_s)
        if self.ledger is None:
            return
        self.ledger.record(
            LedgerEntry(
                decided_at=utcnow(),
                replica=self.replica,
                tenant=tenant.id,
                tier=tier,
                scope=scope,
                session_id=admitted[0].id if admitted else None,
                decision=decision.decision.value,
                reason=decision.reason.value,
                retry_after_s=decision.retry_after_s,
                latency_us=int(latency_s * 1e6),
                signals={
                    **decision.signals,
                    "max_parallel": need.max_parallel,
                    "expected_calls": need.expected_calls,
                    "deadline_s": need.deadline_s,
                },
            )
        )

    def store_for(self, session_id: str) -> AdmissionState:
        """The store holding ``session_id``: the fallback only for sessions it admitted."""
        if self.fallback is not None and self.fallback.holds(session_id):
            return self.fallback
        return self.state

    def learn_pace(self, before: SessionRecord, now_ms: int) -> None:
        """A session its client closed (``before`` is its record as it stood): how long it
        took. One that ran out of its deadline first (the lease expired there) took its whole
        deadline; a second ``DELETE`` of it counts again, which errs slow. One that idled out
        says nothing of its pace."""
        if self.pace is None:
            return
        if before.state is SessionState.ACTIVE:
            ended_ms = now_ms
        elif before.state is SessionState.EXPIRED and before.expires_ms >= before.deadline_ms:
            ended_ms = before.deadline_ms
        else:
            self.ended_unlearned(before.id)
            return
        self.pace.observe(
            now_ms / 1000,
            (ended_ms - before.created_ms) / 1000,
            expected_calls=before.expected_calls,
            max_parallel=before.max_parallel,
            est_output_tokens=before.est_output_tokens,
            busy=self.busy.since(before.id, ended_ms / 1000),
            session_id=before.id,
        )

    def ended_unlearned(self, session_id: str) -> None:
        """``session_id`` ended with nothing of its pace learned here: it idled out, or another
        front door closed it (and learns its pace). No longer open (``SessionPace.opened``)."""
        if self.pace is not None:
            self.busy.forget(session_id)
            self.pace.forget(session_id)

    def ends_missed(self) -> None:
        """Sessions may have been closed by other front doors unheard (the release feed was
        down): the open ones are forgotten, for any of them may be a session long ended that
        would go on looking slower and slower (``SessionPace.forget_open``)."""
        if self.pace is not None:
            self.pace.forget_open()

    def room_freed(self, session_id: str) -> None:
        """``session_id``'s reservation was released here: the held sessions are decided
        again, in turn, at once."""
        self._admitted_recently.drop(session_id)
        self.held.wake()


def _span_attributes(
    tenant: Tenant,
    need: SessionNeed,
    decision: AdmissionDecision,
    scope: str,
    admitted: tuple[SessionRecord, bool] | None,
) -> dict[str, str | int | float]:
    out: dict[str, str | int | float] = {
        "kvgate.tenant": tenant.id,
        "kvgate.tier": need.tier.value,
        "kvgate.scope": scope,
        "kvgate.decision": decision.decision.value,
        "kvgate.reason": decision.reason.value,
        "kvgate.need_tokens": need.reserve_tokens,
        "kvgate.max_parallel": need.max_parallel,
    }
    if decision.retry_after_s is not None:
        out["kvgate.retry_after_s"] = decision.retry_after_s
    if admitted is not None:
        out["kvgate.session_id"] = admitted[0].id
    for name, value in decision.signals.items():
        if value is not None:
            out[f"kvgate.signal.{name}"] = value
    return out
