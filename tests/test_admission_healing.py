"""The shared admission state stays true when the world is not: a replica with a wrong clock,
keys lost or corrupted, a Redis that evicts keys (``broker/admission/redis_store.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from broker.admission.redis_store import RedisAdmissionState
from broker.admission.state import ReserveRequest, SessionRecord, TenantLimits
from schemas.vocab import TIERS_BY_PRIORITY, SessionState, Tier
from tests.records import session
from tests.servers import RedisServer

REDIS_URL = "redis://127.0.0.1:6379/0"
LIMITS = (10**9, 10**9, 10**9)
TENANT = TenantLimits(max_sessions=1000, max_parallel_calls=10_000, tokens_per_minute=10**9)
FAST_S = 600.0
"""How far ahead the wrong clock runs: ten minutes, past every idle timeout below."""


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., RedisAdmissionState]]:
    """Stores on one fresh prefix of the machine's Redis, as replicas sharing it."""
    prefix = f"{{kvgate-test-{uuid.uuid4().hex[:10]}}}"
    made: list[RedisAdmissionState] = []

    def make(clock: Callable[[], float] = time.time) -> RedisAdmissionState:
        made.append(RedisAdmissionState(REDIS_URL, prefix=prefix, clock=clock))
        return made[-1]

    try:
        yield make
    finally:
        await made[0].delete_all()
        for store in made:
            await store.close()


async def reserve(store: RedisAdmissionState, record: SessionRecord, now_ms: int) -> None:
    outcome = await store.reserve(ReserveRequest(record, LIMITS, TENANT, 0), now_ms)
    assert outcome.admitted, outcome


async def test_a_replica_whose_clock_runs_fast_expires_nobody_early(
    stores: Callable[..., RedisAdmissionState],
) -> None:
    def fast_clock() -> float:
        return time.time() + FAST_S

    right, fast = stores(), stores(fast_clock)
    now_ms = int(time.time() * 1000)
    await reserve(right, session("on-time", now=now_ms), now_ms)
    fast_now = int(fast_clock() * 1000)
    await reserve(fast, session("from-fast", now=fast_now), fast_now)
    # The fast replica's sweep, ten minutes ahead by its clock, ends nothing.
    assert await fast.sweep(int(fast_clock() * 1000)) == 0
    for store, clock in ((right, time.time), (fast, fast_clock)):
        for sid in ("on-time", "from-fast"):
            record = await store.get(sid, int(clock() * 1000))
            assert record is not None and record.state is SessionState.ACTIVE, (sid, record)
            # Each replica reads the lease on its own clock: about 30 s from its now.
            left_s = record.expires_ms / 1000 - clock()
            assert 20 < left_s <= 30, (sid, left_s)
    assert await right.reserved_tokens() == 2_000


async def test_heal_recomputes_totals_and_mends_the_expiry_index(
    stores: Callable[..., RedisAdmissionState],
) -> None:
    store = stores()
    prefix = store.prefix
    now_ms = int(time.time() * 1000)
    for sid in ("a", "b", "c"):
        await reserve(store, session(sid, now=now_ms), now_ms)
    assert await store.heal(now_ms) == 0  # nothing is wrong yet
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        # What lost and stray keys leave behind: a total off, one negative, a lease with no
        # expiry entry (it would never end), an expiry entry for no lease.
        await client.hset(f"{prefix}:totals", "tier:standard", 999_999)
        await client.hset(f"{prefix}:totals", "sessions:acme", -3)
        await client.hset(f"{prefix}:totals", "active:standard:acme", 7)
        await client.zrem(f"{prefix}:expiry", "b")
        await client.zadd(f"{prefix}:expiry", {"ghost": now_ms + 1_000})
        assert await store.heal(now_ms) == 5
        held = await store.holdings("acme", now_ms)
        assert held.reserved_by_tier[Tier.STANDARD] == 3_000 and held.tenant_sessions == 3
        assert await store.active_sessions() == {(Tier.STANDARD, "acme"): 3}
        assert await client.zscore(f"{prefix}:expiry", "b") is not None
        assert await client.zscore(f"{prefix}:expiry", "ghost") is None
        assert await store.heal(now_ms) == 0
        # Every lease still ends, and the totals come back to zero exactly.
        for sid in ("a", "b", "c"):
            await store.release(sid, SessionState.CLOSED, now_ms + 1)
        totals = await client.hgetall(f"{prefix}:totals")
        assert all(int(v) == 0 for v in totals.values()), totals
        assert await store.reserved_tokens() == 0
        assert {t: 0 for t in TIERS_BY_PRIORITY} == (
            await store.holdings("acme", now_ms + 2)
        ).reserved_by_tier
    finally:
        await client.aclose()


async def test_a_redis_that_evicts_keys_is_refused(redis_server: RedisServer) -> None:
    keeps = RedisAdmissionState(redis_server.url)
    try:
        await keeps.require_noeviction()  # Redis's default policy
        client = aioredis.Redis.from_url(redis_server.url)
        await client.config_set("maxmemory-policy", "allkeys-lru")
        await client.aclose()
        with pytest.raises(ValueError, match="maxmemory-policy allkeys-lru"):
            await keeps.require_noeviction()
    finally:
        await keeps.close()
