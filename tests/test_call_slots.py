"""Calls waiting for their session's call slots on two front doors (two ``SessionLeases``, each
with its own store) sharing one Redis: a call ending on one wakes a call waiting on the other
through the release feed, waiting costs Redis almost nothing, and the feed outlives a Redis
restart. Each test runs its own Redis server, so that the commands counted are its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from broker.admission.admitter import Admitter
from broker.admission.leases import SessionLeases
from broker.admission.metrics import AdmissionMetrics
from broker.admission.redis_store import RedisAdmissionState
from broker.admission.signals import FleetSignals
from broker.admission.state import CallCharge, ReserveRequest, SessionRecord, TenantLimits
from broker.admission.tenants import Tenant, load_tenancy
from broker.errors import SessionClosed
from broker.fleet import FleetView
from broker.settings import ApiSettings
from schemas.vocab import Reason, SessionState, Tier
from tests.polling import poll_until
from tests.servers import RedisServer

LIGHT = CallCharge(tokens=1, in_flight_limit=1_000_000, tokens_per_minute=1_000_000)

SESSIONS = 4
CALLS_PER_SESSION = 10
"""Calls waiting on front door A for each session, whose one slot a call on B holds."""
WAIT_WINDOW_S = 3.0
"""How long the test lets them wait while it counts Redis commands: waiting is the behaviour
under test, so this is a sleep. Each asking every 50 ms, 40 calls asked ~2,400 times in it."""
DRAIN_BOUND_S = 30.0
"""For all the waiting calls to get their slots one after another once B's calls end: each is
woken by the one before it; generous for a loaded 2-core machine."""
WAKE_BOUND_S = 10.0
"""For a call waiting on A to get the slot a call on B freed. Generous for a loaded machine,
yet far below the head's poll, which these tests stretch to ``SLOW_POLL_S``."""
SLOW_POLL_S = 120.0
"""The waiting head's poll in the wake tests: only a wake can let the call through in time."""
REDIS_BOUND_S = 20.0
"""For the release feed to subscribe again after a restart (it backs off up to 10 s between
attempts)."""
LIMITS = (10**9, 10**9, 10**9)
SCRIPT_STATS = ("cmdstat_evalsha", "cmdstat_eval")
ACME = Tenant(id="acme", key_sha256="0" * 64, max_tier=Tier.STANDARD)
TENANT = TenantLimits(max_sessions=1000, max_parallel_calls=10_000, tokens_per_minute=10**9)


@dataclass
class FrontDoor:
    store: RedisAdmissionState
    leases: SessionLeases


@contextlib.asynccontextmanager
async def front_door(url: str) -> AsyncIterator[FrontDoor]:
    """What one front door holds of admission, its release feed followed."""
    store = RedisAdmissionState(url, prefix="{kvgate-slots}", timeout_s=5)
    admitter = Admitter(
        ApiSettings(),
        load_tenancy(None, Tier.STANDARD),
        store,
        FleetSignals(FleetView(6.0)),
        AdmissionMetrics(CollectorRegistry()),
        None,
        shared=True,
    )
    leases = SessionLeases(admitter)
    leases.start()
    try:
        yield FrontDoor(store, leases)
    finally:
        await leases.stop()
        await store.close()


async def open_session(store: RedisAdmissionState, parallel: int = 1) -> SessionRecord:
    now = int(time.time() * 1000)
    record = SessionRecord(
        id=f"sess_{uuid.uuid4().hex}",
        tenant="acme",
        tier=Tier.STANDARD,
        state=SessionState.ACTIVE,
        max_parallel=parallel,
        expected_calls=CALLS_PER_SESSION,
        est_prompt_tokens=100,
        est_output_tokens=10,
        reserved_tokens=110 * parallel,
        created_ms=now,
        deadline_ms=now + 600_000,
        idle_timeout_ms=600_000,
        expires_ms=now + 600_000,
    )
    outcome = await store.reserve(ReserveRequest(record, LIMITS, TENANT, 0), now)
    assert outcome.reason is Reason.ADMITTED
    return record


def deadline_ms() -> int:
    return int(time.time() * 1000) + 300_000


@contextlib.asynccontextmanager
async def slot_held(door: FrontDoor, record: SessionRecord) -> AsyncIterator[None]:
    """One call of ``record`` in flight on ``door`` until the block ends."""
    ended = asyncio.Event()
    holding = asyncio.Event()

    async def call() -> None:
        async with door.leases.call_slot(record, f"held-{uuid.uuid4().hex}", deadline_ms(), LIGHT):
            holding.set()
            await ended.wait()

    task = asyncio.create_task(call())
    await holding.wait()
    try:
        yield
    finally:
        ended.set()
        await task


async def waiting(door: FrontDoor, n: int) -> None:
    """Until ``n`` calls wait for a slot on ``door``."""
    await poll_until(
        lambda: asyncio.sleep(0, door.leases.waiters.waiting), lambda w: w == n, timeout_s=10
    )


async def scripts_run(client: aioredis.Redis) -> int:
    """The admission scripts the server has run: every question a front door asks of the
    state is one (the commands a script runs are counted apart, under their own names)."""
    stats = await client.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in SCRIPT_STATS)


async def test_waiting_calls_barely_touch_redis_and_wake_when_another_door_frees_a_slot(
    redis_server: RedisServer,
) -> None:
    in_slot: dict[str, int] = {}
    peak = 0
    got_slot = 0

    async with front_door(redis_server.url) as a, front_door(redis_server.url) as b:
        records = [await open_session(a.store) for _ in range(SESSIONS)]

        async def wait_for_slot(record: SessionRecord, i: int) -> None:
            nonlocal peak, got_slot
            async with a.leases.call_slot(record, f"call-{i}", deadline_ms(), LIGHT):
                in_slot[record.id] = in_slot.get(record.id, 0) + 1
                peak = max(peak, in_slot[record.id])
                await asyncio.sleep(0)  # the call "runs": another would overlap it here
                in_slot[record.id] -= 1
                got_slot += 1

        async with contextlib.AsyncExitStack() as held:
            for record in records:
                await held.enter_async_context(slot_held(b, record))
            calls = [
                asyncio.create_task(wait_for_slot(record, i))
                for record in records
                for i in range(CALLS_PER_SESSION)
            ]
            await waiting(a, SESSIONS * CALLS_PER_SESSION)
            counter = aioredis.Redis.from_url(redis_server.url)
            try:
                before = await scripts_run(counter)
                await asyncio.sleep(WAIT_WINDOW_S)
                spent = await scripts_run(counter) - before
            finally:
                await counter.aclose()
        # B's calls have ended: A's waiting calls now take the slots one after another.
        async with asyncio.timeout(DRAIN_BOUND_S):
            await asyncio.gather(*calls)

    # Fewer questions in the whole window than there are calls waiting: only each session's
    # first waiting call asks again, about once a second.
    assert spent < SESSIONS * CALLS_PER_SESSION, spent
    assert got_slot == SESSIONS * CALLS_PER_SESSION
    assert peak == 1  # never more than the session's max_parallel


async def test_a_call_waiting_on_one_door_is_woken_by_a_call_ending_on_another(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.admission.waiters.POLL_S", SLOW_POLL_S)
    async with front_door(redis_server.url) as a, front_door(redis_server.url) as b:
        await woken_by_the_other(a, b)

        closed = await open_session(a.store)
        async with slot_held(a, closed):
            late = asyncio.create_task(_take_slot(b, closed))
            await waiting(b, 1)
            await a.leases.close(ACME, closed.id)
            async with asyncio.timeout(WAKE_BOUND_S):
                with pytest.raises(SessionClosed):
                    await late


async def test_the_release_feed_outlives_a_redis_restart(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.admission.waiters.POLL_S", SLOW_POLL_S)
    async with front_door(redis_server.url) as a, front_door(redis_server.url) as b:
        redis_server.stop()
        redis_server.start()
        counter = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            channel = f"{a.store.prefix}:freed"
            await poll_until(
                lambda: counter.pubsub_numsub(channel),
                lambda subscribed: subscribed == [(channel, 2)],
                timeout_s=REDIS_BOUND_S,
            )
        finally:
            await counter.aclose()
        await woken_by_the_other(a, b)


async def woken_by_the_other(a: FrontDoor, b: FrontDoor) -> None:
    """A call waits on ``a`` for the one slot of a session while a call on ``b`` holds it, and
    gets the slot within ``WAKE_BOUND_S`` of the call on ``b`` ending."""
    record = await open_session(a.store)
    async with slot_held(b, record):
        call = asyncio.create_task(_take_slot(a, record))
        await waiting(a, 1)
    async with asyncio.timeout(WAKE_BOUND_S):
        await call


async def _take_slot(door: FrontDoor, record: SessionRecord) -> None:
    async with door.leases.call_slot(record, f"call-{uuid.uuid4().hex}", deadline_ms(), LIGHT):
        pass


async def test_a_session_closed_on_another_door_is_no_longer_open_where_it_was_admitted(
    redis_server: RedisServer,
) -> None:
    """The front door that admitted a session follows it as open, a lower bound on the pace
    of sessions (``SessionPace.opened``), until it ends: another front door's close reaches it
    over the release feed, or the session would look slower and slower until its deadline."""
    async with front_door(redis_server.url) as a, front_door(redis_server.url) as b:
        pace = a.leases.admitter.pace
        assert pace is not None
        record = await open_session(a.store)
        pace.opened(
            record.id,
            record.created_ms / 1000,
            expected_calls=record.expected_calls,
            max_parallel=record.max_parallel,
            est_output_tokens=record.est_output_tokens,
            deadline_s=600.0,
        )
        kept = await open_session(a.store)
        pace.opened(
            kept.id,
            kept.created_ms / 1000,
            expected_calls=1,
            max_parallel=1,
            est_output_tokens=10,
            deadline_s=600.0,
        )
        await b.leases.close(ACME, record.id)
        await poll_until(
            lambda: asyncio.sleep(0, pace.is_open(record.id)),
            lambda still: not still,
            timeout_s=WAKE_BOUND_S,
        )
        assert pace.is_open(kept.id)
        await a.leases.close(ACME, kept.id)  # closed where it was admitted: learned there
        assert not pace.is_open(kept.id)
