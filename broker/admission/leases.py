"""An admitted session's life after its admission: read it, hold its call slots, close it.

A session's lease lives in the admission state that admitted it (``Admitter.store_for``: the
shared store, or this replica's fallback for sessions admitted while the shared store was
unreachable). Every release wakes the sessions held for room on this replica
(``Admitter.room_freed``); a session its client closes teaches the admitter its pace.

Calls beyond a session's ``max_parallel`` wait in ``SlotWaiters`` (bounded, woken one per freed
slot): by this replica when one of its calls ends, by the shared state's release feed
(``start``) when a call ends on another.

A release that cannot reach the shared state (Redis down as a call ends) is owed, not dropped:
it is tried again every ``RETRY_RELEASES_S`` until the state answers, so a call slot or a plain
call's session is not held until its deadline by an outage that ended long before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from broker.admission.admitter import Admitter
from broker.admission.state import CallCharge, SessionRecord, SlotStatus, minute_window
from broker.admission.tenants import Tenant
from broker.admission.waiters import SlotWaiters
from broker.errors import (
    AdmissionUnavailable,
    CallExceedsSession,
    DeadlineExceeded,
    SessionClosed,
    SessionExpired,
    SessionNotFound,
    TenantQuota,
)
from schemas.vocab import Decision, SessionState

log = logging.getLogger(__name__)

RETRY_RELEASES_S = 1.0
"""How often owed releases are tried again while the shared state is unreachable."""
MAX_OWED_RELEASES = 100_000
"""Beyond this many, the oldest owed release is given up (its lease still ends at its expiry,
which the state enforces by itself): an outage must not grow this replica's memory unbounded."""

OwedRelease = tuple[str, str | None]
"""A session id and the call whose slot is owed back, or ``None``: the whole (one-call)
session."""


class SessionLeases:
    def __init__(self, admitter: Admitter) -> None:
        self.admitter = admitter
        settings = admitter.settings
        self.waiters = SlotWaiters(settings.session_max_waiting_calls, settings.max_waiting_calls)
        self._feed: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        self._owed: dict[OwedRelease, None] = {}
        """Releases the shared state did not take, oldest first (a dict: an ordered set)."""

    @property
    def owed_releases(self) -> int:
        return len(self._owed)

    def start(self) -> None:
        """Follow the shared state's release feed, so that a call ending on another replica
        wakes a call waiting here at once; try owed releases again."""
        self._feed = asyncio.create_task(self._follow_releases())
        self._retrier = asyncio.create_task(self._retry_releases())

    async def stop(self) -> None:
        for task in (self._feed, self._retrier):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _release(self, owed: OwedRelease) -> bool:
        """Give ``owed`` back to the shared state; ``False`` where it could not be reached
        (the release is then owed). Releasing twice releases once."""
        session_id, call_id = owed
        store = self.admitter.store_for(session_id)
        now_ms = int(time.time() * 1000)
        try:
            if call_id is None:
                await store.release(session_id, SessionState.CLOSED, now_ms)
            else:
                await store.release_call(session_id, call_id, now_ms)
        except AdmissionUnavailable:
            if len(self._owed) >= MAX_OWED_RELEASES:
                self._owed.pop(next(iter(self._owed)))
            if not self._owed:
                log.warning("admission state unreachable: releases are owed until it is back")
            self._owed[owed] = None
            return False
        return True

    async def _retry_releases(self) -> None:
        while True:
            await asyncio.sleep(RETRY_RELEASES_S)
            for owed in list(self._owed):
                del self._owed[owed]
                if not await self._release(owed):
                    break  # still unreachable: the rest wait for the next round
                session_id, call_id = owed
                if call_id is None:
                    self.admitter.room_freed(session_id)
                else:
                    self.waiters.call_ended(session_id)

    async def _follow_releases(self) -> None:
        try:
            await self.admitter.state.follow_releases(_Ends(self.waiters, self.admitter))
        except Exception:
            # Not expected (the feed outlives Redis itself); waiting calls still poll.
            log.exception("the release feed stopped; calls waiting for a slot poll")

    async def get(self, tenant: Tenant, session_id: str) -> SessionRecord:
        """The tenant's session; ``session_not_found`` for anyone else's (never 403: that
        would confirm that the id exists)."""
        now_ms = int(time.time() * 1000)
        record = await self.admitter.store_for(session_id).get(session_id, now_ms)
        if record is None or record.tenant != tenant.id:
            raise SessionNotFound(f"no session {session_id!r}", param="session")
        return record

    async def close(self, tenant: Tenant, session_id: str) -> SessionRecord:
        before = await self.get(tenant, session_id)
        now_ms = int(time.time() * 1000)
        store = self.admitter.store_for(session_id)
        record = await store.release(session_id, SessionState.CLOSED, now_ms)
        if record is None:  # its retention ran out between the two reads
            raise SessionNotFound(f"no session {session_id!r}", param="session")
        self.admitter.learn_pace(before, now_ms)
        self.waiters.session_ended(session_id)
        self.admitter.room_freed(session_id)
        return record

    def charge(
        self, tenant: Tenant, record: SessionRecord, prompt_tokens: int, max_tokens: int
    ) -> CallCharge:
        """What a call of ``prompt_tokens`` and ``max_tokens`` (all its choices) weighs in its
        session (``CallCharge``); ``call_exceeds_session`` for a call that alone weighs more
        than the session may hold in flight, which no wait would change."""
        tokens = prompt_tokens + min(max_tokens, record.est_output_tokens)
        limit = int(record.reserved_tokens * self.admitter.settings.session_overrun)
        if tokens > limit:
            raise CallExceedsSession(
                f"this call weighs {tokens} tokens (its prompt, and its output at the "
                f"session's est_output_tokens {record.est_output_tokens}); session "
                f"{record.id} may hold {limit} in flight ({record.max_parallel} calls declared "
                f"at est_prompt_tokens {record.est_prompt_tokens}): send a smaller call or "
                "open a session that declares calls of this size",
                param="messages",
            )
        return CallCharge(
            tokens=tokens, in_flight_limit=limit, tokens_per_minute=tenant.tokens_per_minute
        )

    @contextlib.asynccontextmanager
    async def call_slot(
        self, record: SessionRecord, call_id: str, call_deadline_ms: int, charge: CallCharge
    ) -> AsyncIterator[SessionRecord]:
        """Hold one of the session's ``max_parallel`` call slots, charged ``charge``. A call
        beyond them (or beyond the weight its session may hold in flight) waits for one of its
        own session's calls to end, up to its deadline; it never takes anyone else's capacity.
        One beyond the waiting bounds (``SlotWaiters``) is refused at once,
        ``too_many_waiting_calls``; one that takes its session past its declaration when the
        tenant's tokens per minute have no room left, ``tenant_quota``."""
        store = self.admitter.store_for(record.id)
        waiter = self.waiters.join(record.id)
        try:
            while True:
                waiter.woken.clear()  # a wake from here on is for the answer below
                now_ms = int(time.time() * 1000)
                status, current = await store.acquire_call(
                    record.id, call_id, call_deadline_ms, now_ms, charge
                )
                if status is SlotStatus.ACQUIRED:
                    break
                if status is SlotStatus.OVER_QUOTA:
                    _, left_s = minute_window(now_ms)
                    raise TenantQuota(
                        f"session {record.id} has used more than it declared "
                        f"({record.declared_tokens} tokens) and its tenant's tokens per minute "
                        "have no room for this call",
                        decision=Decision.REJECT.value,
                        retry_after=max(1, round(left_s)),
                    )
                if status is SlotStatus.CLOSED:
                    raise SessionClosed(f"session {record.id} is closed")
                if status is SlotStatus.EXPIRED:
                    raise SessionExpired(f"session {record.id} has expired")
                if status is SlotStatus.NOT_FOUND:
                    raise SessionNotFound(f"no session {record.id!r}")
                left_s = call_deadline_ms / 1000 - time.time()
                if left_s <= 0:
                    raise DeadlineExceeded(
                        f"the session's {record.max_parallel} call slots stayed busy until "
                        "the call's deadline"
                    )
                if waiter.woken.is_set():  # a slot was freed while it asked
                    continue
                self.waiters.wait(waiter)
                poll_s = self.waiters.timeout_s(waiter)
                wait_s = left_s if poll_s is None else min(poll_s, left_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.woken.wait(), wait_s)
        finally:
            self.waiters.leave(waiter)
        try:
            yield current or record
        finally:
            await self._release((record.id, call_id))
            self.waiters.call_ended(record.id)

    async def end_one_call_session(self, record: SessionRecord) -> None:
        """Release a plain call's one-call session once its call has ended."""
        await self._release((record.id, None))
        self.admitter.room_freed(record.id)


class _Ends:
    """What the release feed says of other front doors' releases: the calls waiting here for
    a slot hear of it, and so does the admitter of a session it admitted and another front
    door closed (``Admitter.ended_unlearned``)."""

    def __init__(self, waiters: SlotWaiters, admitter: Admitter) -> None:
        self.waiters = waiters
        self.admitter = admitter

    def call_ended(self, session_id: str) -> None:
        self.waiters.call_ended(session_id)

    def session_ended(self, session_id: str) -> None:
        self.waiters.session_ended(session_id)
        self.admitter.ended_unlearned(session_id)

    def releases_missed(self) -> None:
        self.waiters.releases_missed()
        self.admitter.ends_missed()
