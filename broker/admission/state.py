"""Admission state: the reservations every front-door replica must agree on.

One interface, two implementations that pass the same contract tests
(``tests/test_admission_state.py``): ``RedisAdmissionState`` (``broker.admission.redis_store``,
atomic Lua scripts, shared by replicas) and ``MemoryAdmissionState`` here (one replica).

Invariants a reader must not break:
- ``reserve`` re-checks every ceiling (nested tier groups, tenant quotas) in the same atomic
  step that adds the reservation: the policy's answer came from a snapshot another replica may
  have changed since.
- A session's lease expires at the earlier of its deadline and ``idle_timeout`` after its last
  call ended (never while one of its calls is in flight, up to that call's own deadline). Any
  replica's next operation sweeps expired leases, so a reservation is released even when the
  replica that made it has died.
- A released session keeps its record for ``retention_ms`` so that a late call gets 409/410,
  not 404.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from broker.admission.policy import Holdings
from schemas.vocab import TIERS_BY_PRIORITY, Reason, SessionState, Tier

RELEASE_BUCKET_MS = 10_000
RELEASE_WINDOW_BUCKETS = 6
DEFAULT_RETENTION_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    tenant: str
    tier: Tier
    state: SessionState
    max_parallel: int
    expected_calls: int
    est_prompt_tokens: int
    est_output_tokens: int
    reserved_tokens: int
    created_ms: int
    deadline_ms: int
    idle_timeout_ms: int
    expires_ms: int
    ended_ms: int | None = None
    calls_started: int = 0
    tokens_used: int = 0
    """The calls' charges so far (``CallCharge.tokens``)."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def declared_tokens(self) -> int:
        """What the session declared it would use in all (``expected_calls`` calls of its
        estimated size): charged to its tenant's tokens per minute when it was admitted."""
        return self.expected_calls * (self.est_prompt_tokens + self.est_output_tokens)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_sessions: int
    max_parallel_calls: int
    tokens_per_minute: int
    max_reserved_tokens: int | None = None
    """The most KV tokens the tenant's live sessions may hold reserved together; ``None``:
    only the tiers' shares bound them."""


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    record: SessionRecord
    tier_limits: tuple[int, ...]
    """Token ceiling of each nested tier group, highest tier first."""
    tenant_limits: TenantLimits
    tokens_charged: int
    """Charged to the tenant's tokens-per-minute window."""
    idempotency_key: str | None = None


@dataclass(frozen=True, slots=True)
class ReserveOutcome:
    reason: Reason
    record: SessionRecord | None = None
    existing: bool = False
    """An earlier create with the same idempotency key: ``record`` is that session."""
    shortfall_tokens: int = 0

    @property
    def admitted(self) -> bool:
        return self.record is not None


@dataclass(frozen=True, slots=True)
class CallCharge:
    """What a call of a session weighs against the session's declaration (issue: a session
    must not be a way around its tenant's quotas by declaring small and sending large).

    ``tokens`` is the call's prompt plus its output counted at the session's estimate (never
    above the call's own ``max_tokens``): agents set ``max_tokens`` far above what they expect,
    so charging it would refuse well-declared sessions; output past the estimate is bounded per
    call by ``max_tokens`` and by the worker's KV check. The session's calls in flight may
    weigh at most ``in_flight_limit`` together (a call beyond it waits for a slot, as one beyond
    ``max_parallel`` does); the charges past ``SessionRecord.declared_tokens`` go to the
    tenant's tokens-per-minute window, up to ``tokens_per_minute``."""

    tokens: int
    in_flight_limit: int
    tokens_per_minute: int


class SlotStatus(enum.StrEnum):
    ACQUIRED = "acquired"
    BUSY = "busy"
    """The session already runs ``max_parallel`` calls, or calls that weigh too much to add
    this one (``CallCharge.in_flight_limit``)."""
    OVER_QUOTA = "over_quota"
    """The call would take the session past its declaration and the tenant's tokens per
    minute have no room for the excess."""
    CLOSED = "closed"
    EXPIRED = "expired"
    NOT_FOUND = "not_found"


class ReleaseListener(Protocol):
    """Who hears of call slots freed by other front doors (``SlotWaiters``)."""

    def call_ended(self, session_id: str) -> None: ...

    def session_ended(self, session_id: str) -> None: ...

    def releases_missed(self) -> None:
        """Slots may have been freed unheard (the feed was down): check every session."""
        ...


class AdmissionState(Protocol):
    async def holdings(self, tenant: str, now_ms: int) -> Holdings: ...

    async def reserve(self, request: ReserveRequest, now_ms: int) -> ReserveOutcome: ...

    async def get(self, session_id: str, now_ms: int) -> SessionRecord | None: ...

    async def release(
        self, session_id: str, state: SessionState, now_ms: int
    ) -> SessionRecord | None:
        """End the session (``closed`` or ``expired``) and free its reservation at once.
        Returns the record as it now stands; ``None`` for an unknown session."""
        ...

    async def acquire_call(
        self,
        session_id: str,
        call_id: str,
        call_deadline_ms: int,
        now_ms: int,
        charge: CallCharge,
    ) -> tuple[SlotStatus, SessionRecord | None]:
        """Take one of the session's call slots for ``call_id`` until its deadline (or its
        ``release_call``), and charge it (``CallCharge``)."""
        ...

    async def release_call(self, session_id: str, call_id: str, now_ms: int) -> None: ...

    async def touch(self, session_id: str, now_ms: int) -> None:
        """Keep an active session from idling out for another ``idle_timeout`` (a holder whose
        calls do not pass through call slots: the batch runner)."""
        ...

    async def sweep(self, now_ms: int) -> int:
        """Release every lease past its expiry; returns how many."""
        ...

    async def follow_releases(self, listener: ReleaseListener) -> None:
        """Tell ``listener`` of the call slots and sessions other front doors free, until
        cancelled; never of this one's own (its caller knows them first). Returns at once
        where no other front door shares the state."""
        ...

    async def reserved_tokens(self) -> int:
        """Tokens reserved fleet-wide right now."""
        ...

    async def active_sessions(self) -> dict[tuple[Tier, str], int]:
        """Live sessions (holding a lease) per tier and tenant, fleet-wide; none listed at 0."""
        ...

    async def heal(self, now_ms: int) -> int:
        """Mend what lost or stray keys left wrong (the totals from the leases); returns how
        many entries were wrong."""
        ...

    async def close(self) -> None: ...


def minute_window(now_ms: int) -> tuple[int, float]:
    """The tokens-per-minute window index and the seconds left in it."""
    return now_ms // 60_000, (60_000 - now_ms % 60_000) / 1000


class MemoryAdmissionState:
    """The in-process twin: correct for one front-door replica (``make run``)."""

    def __init__(self, retention_ms: int = DEFAULT_RETENTION_MS) -> None:
        self.retention_ms = retention_ms
        self._records: dict[str, SessionRecord] = {}
        self._leases: set[str] = set()
        self._slots: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)
        """Per session: call id -> (its deadline, its charge's tokens)."""
        self._by_tier: dict[Tier, int] = defaultdict(int)
        self._tenant_sessions: dict[str, int] = defaultdict(int)
        self._tenant_parallel: dict[str, int] = defaultdict(int)
        self._tenant_reserved: dict[str, int] = defaultdict(int)
        self._tpm: dict[tuple[str, int], int] = defaultdict(int)
        self._released: dict[int, int] = defaultdict(int)
        self._idempotency: dict[tuple[str, str], tuple[str, int]] = {}
        # Min-heaps of (when, session id), so that a sweep looks only at what is due. An entry
        # made stale by a later change of the same session (a lease extended, a session
        # closed) is skipped when it comes up; the record is the truth.
        self._expiry: list[tuple[int, str]] = []
        self._forget: list[tuple[int, str]] = []
        self._pruned_window = -1
        self._lock = asyncio.Lock()

    def holds(self, session_id: str) -> bool:
        return session_id in self._records

    async def holdings(self, tenant: str, now_ms: int) -> Holdings:
        async with self._lock:
            self._sweep(now_ms)
            window, left_s = minute_window(now_ms)
            bucket = now_ms // RELEASE_BUCKET_MS
            released = sum(self._released.get(bucket - i, 0) for i in range(RELEASE_WINDOW_BUCKETS))
            return Holdings(
                reserved_by_tier=dict(self._by_tier),
                tenant_sessions=self._tenant_sessions[tenant],
                tenant_parallel=self._tenant_parallel[tenant],
                tenant_tokens_this_minute=self._tpm.get((tenant, window), 0),
                released_tokens_per_s=released / (RELEASE_BUCKET_MS * RELEASE_WINDOW_BUCKETS / 1e3),
                seconds_to_next_minute=left_s,
            )

    async def reserve(self, request: ReserveRequest, now_ms: int) -> ReserveOutcome:
        async with self._lock:
            self._sweep(now_ms)
            record = request.record
            if request.idempotency_key is not None:
                known = self._idempotency.get((record.tenant, request.idempotency_key))
                if known is not None and known[1] > now_ms and known[0] in self._records:
                    return ReserveOutcome(Reason.ADMITTED, self._records[known[0]], existing=True)
            index = TIERS_BY_PRIORITY.index(record.tier)
            held = [self._by_tier[t] for t in TIERS_BY_PRIORITY]
            need = record.reserved_tokens
            for i in range(index, -1, -1):
                group = sum(held[i:]) + need
                if group > request.tier_limits[i]:
                    reason = Reason.FLEET_SATURATED if i == 0 else Reason.TIER_CAPACITY
                    return ReserveOutcome(reason, shortfall_tokens=group - request.tier_limits[i])
            limits = request.tenant_limits
            window, _ = minute_window(now_ms)
            if (
                self._tenant_sessions[record.tenant] + 1 > limits.max_sessions
                or self._tenant_parallel[record.tenant] + record.max_parallel
                > limits.max_parallel_calls
                or self._tpm[(record.tenant, window)] + request.tokens_charged
                > limits.tokens_per_minute
                or (
                    limits.max_reserved_tokens is not None
                    and self._tenant_reserved[record.tenant] + need > limits.max_reserved_tokens
                )
            ):
                return ReserveOutcome(Reason.TENANT_QUOTA)
            self._by_tier[record.tier] += need
            self._tenant_sessions[record.tenant] += 1
            self._tenant_parallel[record.tenant] += record.max_parallel
            self._tenant_reserved[record.tenant] += need
            self._tpm[(record.tenant, window)] += request.tokens_charged
            self._leases.add(record.id)
            self._keep(record)
            if request.idempotency_key is not None:
                expires = now_ms + 24 * 3_600_000
                self._idempotency[(record.tenant, request.idempotency_key)] = (record.id, expires)
            return ReserveOutcome(Reason.ADMITTED, record)

    async def get(self, session_id: str, now_ms: int) -> SessionRecord | None:
        async with self._lock:
            self._sweep(now_ms)
            return self._records.get(session_id)

    async def release(
        self, session_id: str, state: SessionState, now_ms: int
    ) -> SessionRecord | None:
        async with self._lock:
            self._sweep(now_ms)
            self._end(session_id, state, now_ms)
            return self._records.get(session_id)

    async def acquire_call(
        self,
        session_id: str,
        call_id: str,
        call_deadline_ms: int,
        now_ms: int,
        charge: CallCharge,
    ) -> tuple[SlotStatus, SessionRecord | None]:
        async with self._lock:
            self._sweep(now_ms)
            record = self._records.get(session_id)
            if record is None:
                return SlotStatus.NOT_FOUND, None
            if record.state is not SessionState.ACTIVE:
                status = SlotStatus(record.state.value)
                return status, record
            slots = self._slots[session_id]
            for other, (until, _) in list(slots.items()):
                if until <= now_ms:
                    del slots[other]
            in_flight = sum(tokens for _, tokens in slots.values())
            if (
                len(slots) >= record.max_parallel
                or in_flight + charge.tokens > charge.in_flight_limit
            ):
                return SlotStatus.BUSY, record
            used = record.tokens_used + charge.tokens
            excess = max(0, used - record.declared_tokens) - max(
                0, record.tokens_used - record.declared_tokens
            )
            window, _ = minute_window(now_ms)
            if excess and self._tpm[(record.tenant, window)] + excess > charge.tokens_per_minute:
                return SlotStatus.OVER_QUOTA, record
            self._tpm[(record.tenant, window)] += excess
            slots[call_id] = (call_deadline_ms, charge.tokens)
            expires = min(record.deadline_ms, max(record.expires_ms, call_deadline_ms))
            record = replace(
                record,
                expires_ms=expires,
                calls_started=record.calls_started + 1,
                tokens_used=used,
            )
            self._keep(record)
            return SlotStatus.ACQUIRED, record

    async def release_call(self, session_id: str, call_id: str, now_ms: int) -> None:
        async with self._lock:
            slots = self._slots.get(session_id)
            if slots is not None:
                slots.pop(call_id, None)
            record = self._records.get(session_id)
            if record is None or session_id not in self._leases:
                return
            busy_until = max((until for until, _ in slots.values()), default=0) if slots else 0
            idle_from = max(now_ms + record.idle_timeout_ms, busy_until)
            self._keep(replace(record, expires_ms=min(record.deadline_ms, idle_from)))

    async def touch(self, session_id: str, now_ms: int) -> None:
        async with self._lock:
            self._sweep(now_ms)
            record = self._records.get(session_id)
            if record is None or session_id not in self._leases:
                return
            expires = min(
                record.deadline_ms, max(record.expires_ms, now_ms + record.idle_timeout_ms)
            )
            self._keep(replace(record, expires_ms=expires))

    async def sweep(self, now_ms: int) -> int:
        async with self._lock:
            return self._sweep(now_ms)

    async def reserved_tokens(self) -> int:
        return sum(self._by_tier.values())

    async def active_sessions(self) -> dict[tuple[Tier, str], int]:
        found: dict[tuple[Tier, str], int] = defaultdict(int)
        for session_id in self._leases:
            record = self._records[session_id]
            found[record.tier, record.tenant] += 1
        return dict(found)

    async def follow_releases(self, listener: ReleaseListener) -> None:
        return None

    async def heal(self, now_ms: int) -> int:
        return 0  # one process, one lock: nothing is lost between its keys

    async def close(self) -> None:
        return None

    def _keep(self, record: SessionRecord) -> None:
        """Store a live session's record and schedule its expiry."""
        self._records[record.id] = record
        heapq.heappush(self._expiry, (record.expires_ms, record.id))

    def _sweep(self, now_ms: int) -> int:
        expired = 0
        while self._expiry and self._expiry[0][0] <= now_ms:
            _, session_id = heapq.heappop(self._expiry)
            record = self._records.get(session_id)
            if session_id in self._leases and record is not None and record.expires_ms <= now_ms:
                self._end(session_id, SessionState.EXPIRED, now_ms)
                expired += 1
        while self._forget and self._forget[0][0] <= now_ms:
            _, session_id = heapq.heappop(self._forget)
            record = self._records.get(session_id)
            if record is not None and record.ended_ms is not None:
                del self._records[session_id]
                self._slots.pop(session_id, None)
        window, _ = minute_window(now_ms)
        if window != self._pruned_window:  # the counters below age by the minute
            self._pruned_window = window
            oldest_bucket = now_ms // RELEASE_BUCKET_MS - RELEASE_WINDOW_BUCKETS
            for bucket in [b for b in self._released if b < oldest_bucket]:
                del self._released[bucket]
            for old in [k for k in self._tpm if k[1] < window]:
                del self._tpm[old]
            for used in [k for k, v in self._idempotency.items() if v[1] <= now_ms]:
                del self._idempotency[used]
        return expired

    def _end(self, session_id: str, state: SessionState, now_ms: int) -> None:
        if session_id not in self._leases:
            return
        self._leases.discard(session_id)
        record = self._records[session_id]
        self._by_tier[record.tier] -= record.reserved_tokens
        self._tenant_sessions[record.tenant] -= 1
        self._tenant_parallel[record.tenant] -= record.max_parallel
        self._tenant_reserved[record.tenant] -= record.reserved_tokens
        self._released[now_ms // RELEASE_BUCKET_MS] += record.reserved_tokens
        self._records[session_id] = replace(record, state=state, ended_ms=now_ms)
        heapq.heappush(self._forget, (now_ms + self.retention_ms, session_id))


def now_ms() -> int:
    return int(time.time() * 1000)
