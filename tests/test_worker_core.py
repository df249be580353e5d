"""The worker's pure scheduling state, stepped by hand: no NATS, no engine, no sleeps; the
engine's reading and both clocks are arguments."""

from __future__ import annotations

import pytest

from schemas.vocab import Tier
from workers.core import Start, WorkerCore
from workers.engine import EngineStats
from workers.headroom import HeadroomPolicy
from workers.pullplan import TierView

G, S, B = Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT
POLICY = HeadroomPolicy(high_water=0.9, low_water=0.05, starvation_s=10, guaranteed_reserve=0)
ROOM = int(0.9 * 2048)
"""What ``POLICY`` lets calls commit of ``stats()``'s cache."""
FAR_MS = 10**15
"""A deadline no test reaches."""


def stats(
    usage: float | None = 0.0,
    running: int = 0,
    waiting: int = 0,
    block_size: int = 32,
    capacity: int = 2048,
    preemptions: int = 0,
) -> EngineStats:
    return EngineStats(
        kv_cache_usage=usage,
        num_running=running,
        num_waiting=waiting,
        kv_capacity_tokens=capacity,
        max_num_seqs=16,
        block_size=block_size,
        num_preemptions=preemptions,
    )


def stage(
    core: WorkerCore,
    call_id: str,
    tier: Tier = S,
    *,
    prompt: int = 300,
    max_tokens: int = 300,
    deadline_ms: int = FAR_MS,
    now_s: float = 0.0,
    block_size: int = 32,
    ttft_objective_ms: int | None = None,
    waited_ms: float = 0.0,
) -> int:
    """Stage a call; its cost."""
    staged = core.stage(
        call_id,
        tier,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        block_size=block_size,
        session_started_ms=0,
        deadline_ms=deadline_ms,
        now_s=now_s,
        ttft_objective_ms=ttft_objective_ms,
        waited_ms=waited_ms,
    )
    return staged.cost


def views(*rows: tuple[int, int]) -> list[TierView]:
    """Each tier's (outstanding credit, backlog), highest first."""
    return [TierView(t, o, b) for t, (o, b) in zip((G, S, B), rows, strict=True)]


def test_staged_calls_start_tier_first_while_they_fit_and_the_rest_wait() -> None:
    core = WorkerCore(POLICY)
    # Each call holds 320 tokens of prompt and may add 320 more: two fit (peak 1280), three
    # would not (1920 > 1843).
    assert stage(core, "b", B, now_s=0) == 640
    stage(core, "s", S, now_s=1)
    stage(core, "g", G, now_s=2)
    starts = core.start(stats(), now_s=3)
    assert starts == [Start("g", ROOM, 1, 2), Start("s", ROOM, 2, 2)]
    assert (core.running_ids(), core.staged_ids()) == (["g", "s"], ["b"])
    assert core.committed_tokens(32) == 1280
    assert core.start(stats(), now_s=4) == []  # nothing freed: the best-effort call waits
    core.finish("g")
    assert core.start(stats(), now_s=5) == [Start("b", ROOM - 640, 2, 1)]
    assert core.staged_count == 0


def test_the_engines_own_reading_bounds_the_start_when_it_is_higher() -> None:
    core = WorkerCore(POLICY)
    stage(core, "a")
    stage(core, "b")
    stage(core, "c")
    core.start(stats(), now_s=0)  # two running, so the engine's reading is taken as it is
    core.finish("a")
    # By the worker's own count (640 committed) the third call fits; the engine says 60% of
    # the cache (1229 tokens) is in use: room 614, short of the 640 the call adds.
    assert core.start(stats(usage=0.6, running=2), now_s=1) == []
    assert core.start(stats(usage=0.3, running=2), now_s=2) != []


def test_an_over_committing_mark_falls_back_when_the_engine_preempts_and_climbs_back() -> None:
    policy = HeadroomPolicy(
        high_water=1.3, fallback_high_water=0.9, overcommit_recover_s=10, guaranteed_reserve=0
    )
    core = WorkerCore(policy)

    def started(preemptions: int, now_s: float) -> int:
        # Calls of 320 tokens that may add 320: k of them peak at 640k tokens.
        for n in range(5):
            stage(core, f"{now_s}-{n}", now_s=now_s)
        starts = core.start(stats(preemptions=preemptions), now_s=now_s)
        for call_id in core.running_ids() + core.staged_ids():
            core.finish(call_id)
            core.unstage(call_id)
        return len(starts)

    assert started(preemptions=3, now_s=0.0) == 4  # 2560 <= 1.3 x 2048, past the cache
    assert started(preemptions=3, now_s=1.0) == 4  # no new preemption
    assert started(preemptions=4, now_s=2.0) == 2  # one: 0.9 x 2048 = 1843
    assert started(preemptions=4, now_s=7.0) == 3  # half way back: 1.1 x 2048 = 2252
    assert started(preemptions=4, now_s=12.0) == 4


def test_a_running_calls_generated_tokens_move_its_load() -> None:
    core = WorkerCore(POLICY)
    stage(core, "a", prompt=20, max_tokens=100, block_size=16)
    core.start(stats(block_size=16), now_s=0)
    assert core.committed_tokens(16) == 32 + 112
    # 30 held (two blocks), 90 left to add (six blocks): the budget's rounding shrinks.
    core.generated("a", 10)
    assert core.committed_tokens(16) == 32 + 96
    core.finish("a")
    assert core.committed_tokens(16) == 0


def test_the_cost_estimate_follows_staged_calls() -> None:
    core = WorkerCore(POLICY)
    assert core.est_call_tokens == POLICY.default_call_tokens
    stage(core, "a")  # costs 640
    assert core.est_call_tokens == int(512 + 0.2 * (640 - 512))


def test_a_staged_call_past_its_deadline_expires_unstarted() -> None:
    core = WorkerCore(POLICY)
    stage(core, "late", deadline_ms=1_000)
    stage(core, "on_time", deadline_ms=2_000)
    assert core.expire(now_ms=999) == []
    assert core.expire(now_ms=1_000) == ["late"]
    assert not core.holds("late")
    assert [s.call_id for s in core.start(stats(), now_s=0)] == ["on_time"]
    assert core.expire(now_ms=5_000) == []  # a running call is the engine's, not expired


def test_a_cancelled_staged_call_never_starts_and_a_running_one_is_not_unstaged() -> None:
    core = WorkerCore(POLICY)
    stage(core, "a")
    stage(core, "b")
    assert core.unstage("a")
    assert [s.call_id for s in core.start(stats(), now_s=0)] == ["b"]
    assert not core.unstage("b")
    assert core.is_running("b")


def test_an_idle_engine_reads_as_idle_whatever_its_last_step_reported() -> None:
    core = WorkerCore(POLICY)
    stale = stats(usage=0.4, running=1, waiting=2)
    idle = core.reading(stale)
    assert (idle.kv_cache_usage, idle.num_running, idle.num_waiting) == (0.0, 0, 0)
    assert idle.kv_capacity_tokens == stale.kv_capacity_tokens
    # A staged call is not in the engine yet: the engine is still idle.
    stage(core, "a", prompt=20, max_tokens=20)
    assert core.reading(stale).num_running == 0
    core.start(stale, now_s=0)
    assert core.reading(stale) == stale  # one of this worker's calls runs: the reading stands


def test_the_idle_correction_frees_the_room_a_stale_reading_would_hold() -> None:
    core = WorkerCore(POLICY)
    stage(core, "a")
    stage(core, "b")
    stage(core, "c")
    # Taken at face value, 85% in use leaves no room for any lower-tier call beyond the first.
    started = core.start(stats(usage=0.85, running=1), now_s=0)
    assert [s.call_id for s in started] == ["a", "b"]


def test_a_tier_held_back_past_the_starvation_bound_gets_credit() -> None:
    core = WorkerCore(POLICY)
    # Guaranteed has work waiting beyond its credit: the lower tiers get no doorbell.
    busy = views((1, 5), (0, 0), (0, 0))
    assert core.pulls(stats(), busy, now_s=100) == {G: 3}
    assert core.next_wake_s(now_ms=0, pull_expires_s=30, now_s=0) == POLICY.starvation_s / 2
    assert core.pulls(stats(), busy, now_s=110) == {G: 3}  # at the bound, not past it
    assert core.pulls(stats(), busy, now_s=110.5) == {S: 1, B: 1, G: 3}
    # Once no longer held back, the wait starts again from zero.
    assert core.pulls(stats(), views((1, 1), (1, 0), (1, 0)), now_s=111) == {}
    assert core.next_wake_s(now_ms=0, pull_expires_s=30, now_s=0) == 30
    assert core.pulls(stats(), busy, now_s=112) == {G: 3}


def test_staged_lower_tier_calls_do_not_keep_a_guaranteed_call_from_being_fetched() -> None:
    policy = HeadroomPolicy(high_water=0.9, guaranteed_reserve=0.25)
    core = WorkerCore(policy)
    reading = stats(block_size=16, capacity=1024)
    # Each best-effort call may reach 416 tokens: two start under the high-water mark (921),
    # the third waits staged and leaves no room for more lower-tier calls; 345 tokens are
    # left, in the guaranteed reserve (256) and beside it.
    for i in range(3):
        stage(core, f"be{i}", B, prompt=10, max_tokens=400, block_size=16)
    assert len(core.start(reading, now_s=0)) == 2
    idle_tiers = views((0, 0), (0, 0), (0, 0))
    assert core.pulls(reading, idle_tiers, now_s=1) == {G: 1}
    assert core.pulls(reading, views((1, 0), (0, 0), (0, 0)), now_s=1) == {}
    # A staged guaranteed call that takes what is left: no room for another one.
    stage(core, "g", G, prompt=10, max_tokens=400, block_size=16)
    assert core.pulls(reading, idle_tiers, now_s=1) == {}


def test_next_wake_is_the_soonest_staged_deadline() -> None:
    core = WorkerCore(POLICY)
    assert core.next_wake_s(now_ms=1_000, pull_expires_s=5, now_s=0) == 5
    stage(core, "later", deadline_ms=4_000)
    stage(core, "sooner", deadline_ms=3_000)
    assert core.next_wake_s(now_ms=1_000, pull_expires_s=5, now_s=0) == pytest.approx(2.001)
    assert core.next_wake_s(now_ms=1_000, pull_expires_s=1.5, now_s=0) == 1.5
    assert core.next_wake_s(now_ms=3_500, pull_expires_s=5, now_s=0) == pytest.approx(0.001)


def test_a_call_that_waited_half_its_first_token_objective_starts_past_the_mark() -> None:
    policy = HeadroomPolicy(
        high_water=0.9, guaranteed_reserve=0, rescue_after=0.5, rescue_overcommit=0.25
    )
    core = WorkerCore(policy)
    for n in range(2):
        stage(core, f"r{n}")
    assert len(core.start(stats(), now_s=0)) == 2  # a peak of 1,280 of the mark's 1,843
    # 640 more would pass the mark (1,920); it came 100 ms after its publish with an
    # objective of 1 s, so it is due 400 ms after it was staged, and the core wakes then.
    stage(core, "late", now_s=10.0, ttft_objective_ms=1_000, waited_ms=100)
    assert core.next_wake_s(now_ms=0, pull_expires_s=30, now_s=10.0) == pytest.approx(0.401)
    assert core.start(stats(running=2), now_s=10.3) == []
    # Due: it may take the allowance (a quarter of the cache, 512 tokens) past the mark.
    assert core.start(stats(running=2), now_s=10.4) == [Start("late", ROOM - 1280, 3, 1, True)]
    assert core.committed_tokens(32) == 1920
