"""The worker's pure headroom step: never commit past the high-water mark (the running set's
predicted peak), tiers in order."""

from __future__ import annotations

import random

import pytest

from schemas.vocab import Tier
from workers.engine import EngineStats
from workers.headroom import (
    Headroom,
    HeadroomPolicy,
    Load,
    StagedCall,
    call_load,
    engine_priority,
    fetchable_calls,
    headroom,
    high_water_after_preemption,
    predicted_peak,
    select_starts,
    start_order,
)

G, S, B = Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT
POLICY = HeadroomPolicy(high_water=0.9, low_water=0.05, starvation_s=10, guaranteed_reserve=0)


def stats(usage: float | None = 0.0, capacity: int | None = 2048, seqs: int = 16) -> EngineStats:
    return EngineStats(
        kv_cache_usage=usage,
        num_running=0,
        num_waiting=0,
        kv_capacity_tokens=capacity,
        max_num_seqs=seqs,
        block_size=32,
    )


def test_headroom_takes_the_larger_of_committed_and_observed() -> None:
    # Committed 500, engine reports 40% of 2048 (820): the engine's reading wins.
    room = headroom(stats(0.4), committed_tokens=500, committed_seqs=3, policy=POLICY)
    assert (room.tokens, room.seqs) == (int(0.9 * 2048) - 820, 13)
    # An engine that has not reported yet: the worker's own reservations still count.
    room = headroom(stats(None), committed_tokens=1000, committed_seqs=2, policy=POLICY)
    assert room.tokens == int(0.9 * 2048) - 1000


def test_waiting_bound_allows_calls_beyond_max_num_seqs() -> None:
    policy = HeadroomPolicy(max_waiting=4)
    room = headroom(stats(), committed_tokens=0, committed_seqs=16, policy=policy)
    assert room.seqs == 4


def staged(key: str, tier: Tier, cost: int, arrived: float = 0.0) -> StagedCall:
    return StagedCall(key, tier, cost, arrived)


def test_starts_highest_tier_first_and_never_past_the_room() -> None:
    calls = [staged("b1", B, 300, 0), staged("g1", G, 300, 1), staged("s1", S, 300, 2)]
    chosen = select_starts(calls, Headroom(700, 16), engine_idle=False, now_s=3, policy=POLICY)
    assert [c.key for c, _ in chosen] == ["g1", "s1"]


def test_a_call_that_does_not_fit_is_not_jumped_by_smaller_lower_tier_calls() -> None:
    calls = [staged("g-big", G, 600), staged("b-small", B, 32)]
    chosen = select_starts(calls, Headroom(500, 16), engine_idle=False, now_s=1, policy=POLICY)
    assert chosen == []


def test_an_oversized_call_runs_alone_on_an_idle_engine() -> None:
    calls = [staged("huge", S, 5000), staged("next", S, 32, 1)]
    chosen = select_starts(calls, Headroom(1800, 16), engine_idle=True, now_s=2, policy=POLICY)
    assert [c.key for c, _ in chosen] == ["huge"]


def test_a_starved_lower_tier_call_goes_first() -> None:
    calls = [staged("g1", G, 300, 20), staged("b-old", B, 300, 0)]
    chosen = select_starts(calls, Headroom(300, 16), engine_idle=False, now_s=21, policy=POLICY)
    assert [c.key for c, _ in chosen] == ["b-old"]


def test_sequence_slots_bound_the_starts() -> None:
    calls = [staged(f"c{i}", S, 32, i) for i in range(5)]
    chosen = select_starts(calls, Headroom(10_000, 2), engine_idle=False, now_s=9, policy=POLICY)
    assert [c.key for c, _ in chosen] == ["c0", "c1"]


def test_fetchable_calls_accounts_for_staged_calls() -> None:
    room = Headroom(tokens=1800, seqs=16)
    assert (
        fetchable_calls(
            room,
            staged=[],
            capacity_tokens=2048,
            est_call_tokens=200,
            engine_idle=False,
            policy=POLICY,
        )
        == 9
    )
    assert (
        fetchable_calls(
            room,
            staged=[staged("a", S, 600)],
            capacity_tokens=2048,
            est_call_tokens=200,
            engine_idle=False,
            policy=POLICY,
        )
        == 6
    )


def test_below_the_low_water_mark_nothing_is_fetched() -> None:
    room = Headroom(tokens=100, seqs=16)  # under 5% of 2048 free
    assert (
        fetchable_calls(
            room,
            staged=[],
            capacity_tokens=2048,
            est_call_tokens=16,
            engine_idle=False,
            policy=POLICY,
        )
        == 0
    )


def test_an_idle_worker_always_asks_for_one_call() -> None:
    room = Headroom(tokens=230, seqs=8)
    assert (
        fetchable_calls(
            room,
            staged=[],
            capacity_tokens=256,
            est_call_tokens=512,
            engine_idle=True,
            policy=POLICY,
        )
        == 1
    )


def test_the_guaranteed_reserve_sits_above_the_high_water_mark() -> None:
    policy = HeadroomPolicy(high_water=0.9, guaranteed_reserve=0.25)
    room = headroom(stats(), committed_tokens=1500, committed_seqs=4, policy=policy)
    assert room.reserved_tokens == 512
    assert room.tokens == 1843 + 512 - 1500
    # Lower tiers may fill the cache up to the mark (1,843 of 2,048), 343 more: a 400-token
    # standard call waits; a guaranteed call may also take the reserve above it, and starts.
    calls = [staged("s", S, 400, 0)]
    assert select_starts(calls, room, engine_idle=False, now_s=1, policy=policy) == []
    calls = [staged("g", G, 800, 0), staged("s", S, 400, 0)]
    chosen = select_starts(calls, room, engine_idle=False, now_s=1, policy=policy)
    assert [c.key for c, _ in chosen] == ["g"]


def test_predicted_peak_is_what_a_step_by_step_run_holds_at_most() -> None:
    """Against a direct simulation: each step every live call holds one more token; a call
    frees all it held when its budget is spent."""
    rng = random.Random(7)
    for _ in range(300):
        loads = [Load(rng.randint(1, 400), rng.randint(0, 300)) for _ in range(rng.randint(1, 9))]
        held = [load.held for load in loads]
        most = sum(held)
        for step in range(1, max(load.remaining for load in loads) + 1):
            most = max(
                most,
                sum(
                    h + step for h, load in zip(held, loads, strict=True) if load.remaining >= step
                ),
            )
        assert predicted_peak(loads) == most, loads


def test_calls_at_different_points_need_less_than_their_worst_cases() -> None:
    nearly_done, just_started = Load(held=160, remaining=32), Load(held=64, remaining=128)
    # Worst cases 192 + 192; the first ends after 32 more tokens, when both hold 192 + 96.
    assert predicted_peak([nearly_done, just_started]) == 288
    # Calls that started together reach their worst cases together.
    assert predicted_peak([just_started, just_started]) == 2 * 192
    assert predicted_peak([]) == 0


def test_call_load_rounds_held_and_remaining_up_to_blocks() -> None:
    assert call_load(40, 100, 0, 32) == Load(held=64, remaining=128)
    assert call_load(40, 100, 30, 32) == Load(held=96, remaining=96)
    assert call_load(40, 100, 100, 32) == Load(held=160, remaining=0)


def test_a_call_starts_when_it_adds_little_to_the_running_peak() -> None:
    running = [Load(held=448, remaining=32)]  # peak 480, ending in 32 tokens
    call = StagedCall("s1", S, cost=512, arrived_s=0, remaining=448)
    room = Headroom(tokens=220, seqs=16)  # a budget of 700, 480 committed
    # Together they peak at 64 + 448 + 2 x 32 = 576: the call adds 96, not its 512.
    chosen = select_starts([call], room, engine_idle=False, now_s=1, policy=POLICY, running=running)
    assert chosen == [(call, False)]
    # Counted as held from the start (its worst case at once), it would not fit.
    held_at_once = StagedCall("s1", S, cost=512, arrived_s=0)
    assert not select_starts(
        [held_at_once], room, engine_idle=False, now_s=1, policy=POLICY, running=running
    )


def test_within_a_tier_an_older_sessions_call_starts_first() -> None:
    new_first = StagedCall("new", S, 64, arrived_s=1, session_started_ms=2_000)
    old_next = StagedCall("old", S, 64, arrived_s=2, session_started_ms=1_000)
    guaranteed = StagedCall("g", G, 64, arrived_s=3, session_started_ms=3_000)
    order = start_order([new_first, old_next, guaranteed], now_s=3, starvation_s=10)
    assert [c.key for c in order] == ["g", "old", "new"]


def test_engine_priority_orders_by_tier_then_by_session_age() -> None:
    now_ms = 1_780_000_000_000
    ordered = [
        engine_priority(G, now_ms),
        engine_priority(S, now_ms - 3_600_000),
        engine_priority(S, now_ms),
        engine_priority(B, 0),
    ]
    assert ordered == sorted(ordered) and len(set(ordered)) == 4


def test_the_mark_after_a_preemption_falls_to_the_fallback_and_climbs_back_linearly() -> None:
    policy = HeadroomPolicy(high_water=1.2, fallback_high_water=0.8, overcommit_recover_s=20)
    assert high_water_after_preemption(policy, None) == 1.2  # never preempted
    assert high_water_after_preemption(policy, 0.0) == pytest.approx(0.8)
    assert high_water_after_preemption(policy, 5.0) == pytest.approx(0.9)
    assert high_water_after_preemption(policy, 20.0) == pytest.approx(1.2)
    assert high_water_after_preemption(policy, 99.0) == pytest.approx(1.2)
    safe = HeadroomPolicy(high_water=0.7, fallback_high_water=0.8)
    assert high_water_after_preemption(safe, 0.0) == 0.7  # a mark under the fallback stays


def test_a_call_due_for_rescue_starts_past_the_mark_within_the_allowance() -> None:
    room = Headroom(tokens=100, seqs=16, rescue_tokens=300)
    waiting = StagedCall("s", S, 320, arrived_s=0, due_s=5.0)
    # Before it is due, it waits for room like any call.
    assert select_starts([waiting], room, engine_idle=False, now_s=4.9, policy=POLICY) == []
    # Due (it waited its share of its first-token objective): 320 fits in 100 + 300.
    chosen = select_starts([waiting], room, engine_idle=False, now_s=5.0, policy=POLICY)
    assert chosen == [(waiting, True)]
    # Past the allowance too, it waits; so does a call that came with no objective.
    too_big = StagedCall("s", S, 420, arrived_s=0, due_s=5.0)
    assert select_starts([too_big], room, engine_idle=False, now_s=9, policy=POLICY) == []
    no_objective = StagedCall("s", S, 320, arrived_s=0)
    assert select_starts([no_objective], room, engine_idle=False, now_s=9, policy=POLICY) == []


def test_due_calls_jump_a_call_that_does_not_fit_first_come_first_served() -> None:
    room = Headroom(tokens=300, seqs=16, rescue_tokens=200)
    head = StagedCall("g-big", G, 1000, arrived_s=0)  # no objective: it waits for room
    due = StagedCall("b-due", B, 400, arrived_s=1, due_s=2.0)
    fits_not_due = StagedCall("b-fits", B, 64, arrived_s=2, due_s=9.0)
    calls = [head, due, fits_not_due]
    chosen = select_starts(calls, room, engine_idle=False, now_s=3, policy=POLICY)
    # The due call starts past the head, in the allowance; the small one is not due, and
    # does not jump the head (which would starve it).
    assert chosen == [(due, True)]
    # A due call that does not fit even in the allowance stops the due calls behind it.
    big_due = StagedCall("s-big-due", S, 600, arrived_s=0, due_s=1.0)
    small_due = StagedCall("b-small-due", B, 64, arrived_s=1, due_s=1.0)
    assert not select_starts([big_due, small_due], room, engine_idle=False, now_s=3, policy=POLICY)
