"""One contract, two admission stores: the in-process twin and Redis (real server, keys under a
prefix of their own per test, deleted afterwards)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from broker.admission.redis_store import RedisAdmissionState
from broker.admission.state import (
    AdmissionState,
    CallCharge,
    MemoryAdmissionState,
    ReserveRequest,
    SessionRecord,
    SlotStatus,
    TenantLimits,
)
from broker.errors import AdmissionUnavailable
from schemas.vocab import Reason, SessionState, Tier
from tests.records import T0, session

REDIS_URL = "redis://127.0.0.1:6379/0"
LIMITS = (10_000, 8_000, 5_000)
TENANT = TenantLimits(max_sessions=10, max_parallel_calls=100, tokens_per_minute=1_000_000)
LIGHT = CallCharge(tokens=1, in_flight_limit=1_000_000, tokens_per_minute=1_000_000)
"""A call that weighs nothing that matters: for the tests of other things than its charge."""


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AdmissionState]:
    if request.param == "memory":
        yield MemoryAdmissionState(retention_ms=60_000)
        return
    redis_store = RedisAdmissionState(
        REDIS_URL, prefix=f"{{kvgate-test-{uuid.uuid4().hex[:10]}}}", retention_ms=60_000
    )
    try:
        yield redis_store
    finally:
        await redis_store.delete_all()
        await redis_store.close()


def request(
    record: SessionRecord,
    *,
    limits: tuple[int, ...] = LIMITS,
    tenant: TenantLimits = TENANT,
    charged: int = 100,
    key: str | None = None,
) -> ReserveRequest:
    return ReserveRequest(record, limits, tenant, charged, key)


async def test_reserve_then_release_returns_the_tokens(store: AdmissionState) -> None:
    outcome = await store.reserve(request(session("s1")), T0)
    assert outcome.reason is Reason.ADMITTED and outcome.record is not None
    assert await store.reserved_tokens() == 1_000
    got = await store.get("s1", T0 + 1)
    assert got is not None and got.metadata == {"agent": "coder", "attempt": 1}
    assert got.state is SessionState.ACTIVE and got.tier is Tier.STANDARD
    held = await store.holdings("acme", T0 + 1)
    assert held.reserved_by_tier[Tier.STANDARD] == 1_000
    assert (held.tenant_sessions, held.tenant_parallel, held.tenant_tokens_this_minute) == (
        1,
        2,
        100,
    )
    closed = await store.release("s1", SessionState.CLOSED, T0 + 2)
    assert closed is not None and closed.state is SessionState.CLOSED
    assert closed.ended_ms == T0 + 2
    assert await store.reserved_tokens() == 0
    after = await store.holdings("acme", T0 + 3)
    assert (after.tenant_sessions, after.tenant_parallel) == (0, 0)
    assert after.released_tokens_per_s == pytest.approx(1_000 / 60)
    # Releasing twice releases once.
    await store.release("s1", SessionState.CLOSED, T0 + 4)
    assert await store.reserved_tokens() == 0


async def test_live_sessions_are_counted_per_tier_and_tenant(store: AdmissionState) -> None:
    assert await store.active_sessions() == {}
    for sid, tier, tenant in (
        ("s1", Tier.STANDARD, "acme"),
        ("s2", Tier.STANDARD, "acme"),
        ("s3", Tier.GUARANTEED, "acme"),
        ("s4", Tier.STANDARD, "beta"),
    ):
        outcome = await store.reserve(request(session(sid, tier=tier, tenant=tenant)), T0)
        assert outcome.admitted, outcome
    assert await store.active_sessions() == {
        (Tier.STANDARD, "acme"): 2,
        (Tier.GUARANTEED, "acme"): 1,
        (Tier.STANDARD, "beta"): 1,
    }
    await store.release("s1", SessionState.CLOSED, T0 + 1)
    await store.release("s4", SessionState.CLOSED, T0 + 1)
    await store.release("s4", SessionState.CLOSED, T0 + 2)  # twice: counted once
    assert await store.active_sessions() == {
        (Tier.STANDARD, "acme"): 1,
        (Tier.GUARANTEED, "acme"): 1,
    }


async def test_reserve_enforces_the_fleet_total_and_the_nested_tier_groups(
    store: AdmissionState,
) -> None:
    async def reserve(sid: str, tier: Tier, tokens: int) -> tuple[Reason, int]:
        outcome = await store.reserve(request(session(sid, tier=tier, tokens=tokens)), T0)
        return outcome.reason, outcome.shortfall_tokens

    assert await reserve("g1", Tier.GUARANTEED, 2_000) == (Reason.ADMITTED, 0)
    assert await reserve("b1", Tier.BESTEFFORT, 4_500) == (Reason.ADMITTED, 0)
    # Best-effort alone may hold 5,000: 4,500 + 1,000 is 500 over.
    assert await reserve("b2", Tier.BESTEFFORT, 1_000) == (Reason.TIER_CAPACITY, 500)
    # Standard and best-effort together may hold 8,000: 7,500 fits, 8,500 does not.
    assert await reserve("s1", Tier.STANDARD, 3_000) == (Reason.ADMITTED, 0)
    assert await reserve("s2", Tier.STANDARD, 1_000) == (Reason.TIER_CAPACITY, 500)
    # Guaranteed is bounded by the fleet total only: 9,500 held, 10,000 in all.
    assert await reserve("g2", Tier.GUARANTEED, 600) == (Reason.FLEET_SATURATED, 100)
    assert await reserve("g3", Tier.GUARANTEED, 500) == (Reason.ADMITTED, 0)
    assert await store.reserved_tokens() == 10_000


async def test_reserve_enforces_the_tenants_reserved_tokens(store: AdmissionState) -> None:
    quota = replace(TENANT, max_reserved_tokens=2_500)
    assert (await store.reserve(request(session("a", tokens=1_500), tenant=quota), T0)).admitted
    over = await store.reserve(request(session("b", tokens=1_001), tenant=quota), T0)
    assert over.reason is Reason.TENANT_QUOTA
    # Another tenant has its own.
    other = session("c", tokens=1_500, tenant="globex")
    assert (await store.reserve(request(other, tenant=quota), T0)).admitted
    assert (await store.reserve(request(session("d", tokens=1_000), tenant=quota), T0)).admitted
    # Released tokens are the tenant's again, whether closed or expired.
    await store.release("a", SessionState.CLOSED, T0 + 1)
    assert (await store.reserve(request(session("e", tokens=1_500), tenant=quota), T0)).admitted


async def test_reserve_enforces_tenant_quotas(store: AdmissionState) -> None:
    quota = TenantLimits(max_sessions=2, max_parallel_calls=5, tokens_per_minute=250)
    assert (await store.reserve(request(session("a"), tenant=quota), T0)).admitted
    # Parallel calls: 2 + 4 > 5.
    wide = session("b", parallel=4)
    assert (await store.reserve(request(wide, tenant=quota), T0)).reason is Reason.TENANT_QUOTA
    assert (await store.reserve(request(session("c"), tenant=quota), T0)).admitted
    # Concurrent sessions: a third is over 2.
    third = await store.reserve(request(session("d", parallel=1), tenant=quota), T0)
    assert third.reason is Reason.TENANT_QUOTA
    # Another tenant is unaffected.
    other = session("e", tenant="globex")
    assert (await store.reserve(request(other, tenant=quota), T0)).admitted
    # Tokens per minute: 200 charged this minute; 100 more is over 250 until the minute turns.
    await store.release("a", SessionState.CLOSED, T0)
    assert (await store.reserve(request(session("f"), tenant=quota), T0)).reason is (
        Reason.TENANT_QUOTA
    )
    next_minute = T0 + 60_000
    assert (
        await store.reserve(request(session("f", now=next_minute), tenant=quota), next_minute)
    ).admitted


async def test_an_idempotency_key_returns_the_same_session(store: AdmissionState) -> None:
    first = await store.reserve(request(session("s1"), key="k-1"), T0)
    again = await store.reserve(request(session("s2"), key="k-1"), T0 + 5)
    assert again.existing and again.record is not None and again.record.id == "s1"
    assert await store.reserved_tokens() == 1_000
    assert first.record is not None
    other_tenant = await store.reserve(request(session("s3", tenant="globex"), key="k-1"), T0)
    assert not other_tenant.existing


async def test_a_lease_expires_after_its_idle_timeout_and_at_its_deadline(
    store: AdmissionState,
) -> None:
    await store.reserve(request(session("idle", idle_s=10)), T0)
    await store.reserve(request(session("short", deadline_s=5, idle_s=60)), T0)
    assert await store.reserved_tokens() == 2_000
    assert await store.sweep(T0 + 5_000) == 1  # the short deadline
    short = await store.get("short", T0 + 5_001)
    assert short is not None and short.state is SessionState.EXPIRED
    idle = await store.get("idle", T0 + 10_000)  # any operation sweeps
    assert idle is not None and idle.state is SessionState.EXPIRED
    assert await store.reserved_tokens() == 0
    status, _ = await store.acquire_call("idle", "c1", T0 + 20_000, T0 + 10_001, LIGHT)
    assert status is SlotStatus.EXPIRED


async def test_a_call_in_flight_keeps_the_session_alive_until_it_ends(
    store: AdmissionState,
) -> None:
    await store.reserve(request(session("s", idle_s=10, deadline_s=300)), T0)
    status, record = await store.acquire_call("s", "c1", T0 + 60_000, T0 + 1_000, LIGHT)
    assert status is SlotStatus.ACQUIRED and record is not None
    assert record.calls_started == 1 and record.expires_ms == T0 + 60_000
    assert await store.sweep(T0 + 30_000) == 0  # idle timeout passed, but a call runs
    await store.release_call("s", "c1", T0 + 40_000)
    after = await store.get("s", T0 + 40_001)
    assert after is not None and after.expires_ms == T0 + 50_000  # idle from the call's end
    assert await store.sweep(T0 + 50_000) == 1


async def test_calls_beyond_max_parallel_are_busy_until_one_ends(store: AdmissionState) -> None:
    await store.reserve(request(session("s", parallel=2)), T0)
    results = [await store.acquire_call("s", f"c{i}", T0 + 20_000, T0, LIGHT) for i in range(3)]
    assert [status for status, _ in results] == [
        SlotStatus.ACQUIRED,
        SlotStatus.ACQUIRED,
        SlotStatus.BUSY,
    ]
    await store.release_call("s", "c0", T0 + 10)
    status, _ = await store.acquire_call("s", "c2", T0 + 20_000, T0 + 11, LIGHT)
    assert status is SlotStatus.ACQUIRED
    assert (await store.acquire_call("s", "c3", T0 + 80_000, T0 + 12, LIGHT))[0] is SlotStatus.BUSY
    # Slots whose calls outlived their own deadlines (their front door died) free themselves.
    status, _ = await store.acquire_call("s", "c3", T0 + 80_000, T0 + 20_001, LIGHT)
    assert status is SlotStatus.ACQUIRED


async def test_calls_in_flight_may_not_weigh_more_than_their_limit_together(
    store: AdmissionState,
) -> None:
    await store.reserve(request(session("s", parallel=4)), T0)

    def charge(tokens: int) -> CallCharge:
        return CallCharge(tokens=tokens, in_flight_limit=2_000, tokens_per_minute=1_000_000)

    assert (await store.acquire_call("s", "c1", T0 + 20_000, T0, charge(1_500)))[0] is (
        SlotStatus.ACQUIRED
    )
    # A slot is free (4 declared), but the weight is not.
    assert (await store.acquire_call("s", "c2", T0 + 20_000, T0 + 1, charge(600)))[0] is (
        SlotStatus.BUSY
    )
    assert (await store.acquire_call("s", "c2", T0 + 20_000, T0 + 2, charge(500)))[0] is (
        SlotStatus.ACQUIRED
    )
    await store.release_call("s", "c1", T0 + 3)
    status, record = await store.acquire_call("s", "c3", T0 + 20_000, T0 + 4, charge(1_500))
    assert status is SlotStatus.ACQUIRED and record is not None
    assert record.tokens_used == 3_500
    # A call that outlived its deadline (its front door died) no longer weighs anything.
    status, _ = await store.acquire_call("s", "c4", T0 + 90_000, T0 + 20_001, charge(2_000))
    assert status is SlotStatus.ACQUIRED


async def test_use_past_the_declaration_is_charged_to_the_tenants_tokens_per_minute(
    store: AdmissionState,
) -> None:
    # Declared: 4 calls of 500 tokens (2,000), charged 100 at admission in this minute.
    record = session("s", tokens=1_000, parallel=2, idle_s=120)
    assert record.declared_tokens == 2_000
    await store.reserve(request(record, charged=100), T0)

    def charge(tokens: int) -> CallCharge:
        return CallCharge(tokens=tokens, in_flight_limit=10_000, tokens_per_minute=1_000)

    async def call(call_id: str, tokens: int, now: int) -> SlotStatus:
        status, _ = await store.acquire_call("s", call_id, now + 20_000, now, charge(tokens))
        if status is SlotStatus.ACQUIRED:
            await store.release_call("s", call_id, now)
        return status

    assert await call("within", 1_900, T0) is SlotStatus.ACQUIRED
    assert (await store.holdings("acme", T0)).tenant_tokens_this_minute == 100
    assert await call("past", 800, T0 + 1) is SlotStatus.ACQUIRED  # 700 past the declaration
    assert (await store.holdings("acme", T0 + 1)).tenant_tokens_this_minute == 800
    # 200 would be left in the minute: a call of 300 past the declaration does not fit, and
    # takes no slot and no tokens.
    assert await call("over", 300, T0 + 2) is SlotStatus.OVER_QUOTA
    after = await store.get("s", T0 + 3)
    assert after is not None and after.tokens_used == 2_700 and after.calls_started == 2
    assert await call("small", 200, T0 + 3) is SlotStatus.ACQUIRED
    # A new minute has room again.
    assert await call("later", 300, T0 + 60_000) is SlotStatus.ACQUIRED


async def test_closed_and_unknown_sessions_refuse_calls(store: AdmissionState) -> None:
    await store.reserve(request(session("s")), T0)
    await store.release("s", SessionState.CLOSED, T0 + 1)
    assert (await store.acquire_call("s", "c", T0 + 9_000, T0 + 2, LIGHT))[0] is SlotStatus.CLOSED
    assert (await store.acquire_call("nope", "c", T0 + 9_000, T0 + 2, LIGHT))[
        0
    ] is SlotStatus.NOT_FOUND
    assert await store.get("nope", T0) is None
    assert await store.release("nope", SessionState.CLOSED, T0) is None


async def test_an_ended_session_is_forgotten_after_the_retention_time(
    store: AdmissionState,
) -> None:
    await store.reserve(request(session("s")), T0)
    await store.release("s", SessionState.CLOSED, T0)
    assert await store.get("s", T0 + 59_000) is not None
    if isinstance(store, RedisAdmissionState):
        await asyncio.sleep(0)  # Redis forgets by key TTL, on the server's own clock
        return
    assert await store.get("s", T0 + 60_001) is None


async def test_concurrent_reserves_never_exceed_the_limits(store: AdmissionState) -> None:
    sessions = [session(f"s{i}", tier=Tier.GUARANTEED, tokens=700) for i in range(40)]
    tenant = TenantLimits(max_sessions=1000, max_parallel_calls=10_000, tokens_per_minute=10**9)
    outcomes = await asyncio.gather(
        *(store.reserve(request(s, tenant=tenant), T0) for s in sessions)
    )
    admitted = [o for o in outcomes if o.admitted]
    assert len(admitted) == 14  # 14 x 700 = 9,800 <= 10,000 < 15 x 700
    assert await store.reserved_tokens() == 9_800


async def test_redis_unreachable_is_admission_unavailable() -> None:
    store = RedisAdmissionState("redis://127.0.0.1:1/0", timeout_s=0.2)
    try:
        with pytest.raises(AdmissionUnavailable):
            await store.holdings("acme", T0)
        with pytest.raises(AdmissionUnavailable):
            await store.reserve(request(replace(session("s"))), T0)
    finally:
        await store.close()


async def test_touch_keeps_an_active_session_from_idling_out(store: AdmissionState) -> None:
    await store.reserve(request(session("s", idle_s=10, deadline_s=30)), T0)
    await store.touch("s", T0 + 8_000)
    assert await store.sweep(T0 + 12_000) == 0  # idle would have ended it at 10 s
    await store.touch("s", T0 + 17_000)
    await store.touch("s", T0 + 25_000)
    record = await store.get("s", T0 + 25_001)
    assert record is not None and record.expires_ms == T0 + 30_000  # never past the deadline
    assert await store.sweep(T0 + 30_000) == 1
    await store.touch("s", T0 + 30_001)  # an ended session stays ended
    ended = await store.get("s", T0 + 30_002)
    assert ended is not None and ended.state is SessionState.EXPIRED


def test_the_redis_script_declares_no_tier_of_its_own() -> None:
    """The tiers reach the Lua script as an argument on every call (``schemas.vocab`` is the
    one place they are declared): a tier named in the script would drift from the vocabulary."""
    from importlib import resources

    lua = (resources.files("broker.admission") / "store.lua").read_text(encoding="utf-8")
    assert [tier.value for tier in Tier if f"'{tier.value}'" in lua] == []


async def test_a_burst_beyond_the_redis_connections_waits_for_one_instead_of_failing() -> None:
    """More concurrent calls than the pool's connections queue for one (bounded by the
    timeout); they are not answered "admission state unavailable"."""
    store = RedisAdmissionState(
        REDIS_URL, prefix=f"{{kvgate-test-{uuid.uuid4().hex[:8]}}}", max_connections=2
    )
    try:
        answers = await asyncio.gather(*(store.holdings("t", T0) for _ in range(50)))
        assert len(answers) == 50
    finally:
        await store.delete_all()
        await store.close()
