"""The pure admission policy: every reason code, the nested tier shares, Retry-After and the
pressure hysteresis. No server: each decision is a function call."""

from __future__ import annotations

from dataclasses import replace

import pytest

from broker.admission.policy import (
    AdmissionDecision,
    AdmissionPolicy,
    FleetSnapshot,
    Holdings,
    Pressure,
    PressureBands,
    PressureTracker,
    SessionNeed,
    WorkerReading,
    decide,
    fleet_busy,
    fleet_has_room,
    fleet_load,
)
from broker.admission.tenants import DEFAULT_TIERS, Tenant
from schemas.vocab import Decision, Reason, Tier

POLICY = AdmissionPolicy(tiers=DEFAULT_TIERS)
TENANT = Tenant(
    id="acme",
    key_sha256="a" * 64,
    max_tier=Tier.GUARANTEED,
    max_sessions=3,
    max_parallel_calls=40,
    tokens_per_minute=100_000,
)
MAX_AGE_S = 3.0


def worker(
    worker_id: str = "w1",
    *,
    capacity: int = 10_000,
    usage: float = 0.1,
    age_s: float = 0.5,
    draining: bool = False,
    running: int = 2,
    waiting: int = 0,
    seq_tokens_per_s: float | None = None,
) -> WorkerReading:
    return WorkerReading(
        worker_id=worker_id,
        kv_usage=usage,
        kv_capacity_tokens=capacity,
        running=running,
        waiting=waiting,
        max_num_seqs=16,
        seq_tokens_per_s=seq_tokens_per_s,
        age_s=age_s,
        draining=draining,
    )


def fleet(*workers: WorkerReading, pending: int = 0) -> FleetSnapshot:
    return FleetSnapshot(workers or (worker(),), {Tier.STANDARD: pending})


def holdings(
    guaranteed: int = 0,
    standard: int = 0,
    besteffort: int = 0,
    *,
    sessions: int = 0,
    parallel: int = 0,
    tokens: int = 0,
    release_rate: float = 0.0,
) -> Holdings:
    return Holdings(
        reserved_by_tier={
            Tier.GUARANTEED: guaranteed,
            Tier.STANDARD: standard,
            Tier.BESTEFFORT: besteffort,
        },
        tenant_sessions=sessions,
        tenant_parallel=parallel,
        tenant_tokens_this_minute=tokens,
        released_tokens_per_s=release_rate,
        seconds_to_next_minute=17.5,
    )


def need(
    tier: Tier = Tier.STANDARD, parallel: int = 4, *, least: int | None = None, **kw: float
) -> SessionNeed:
    """``least`` is ``min_parallel``: by default the session takes all of ``parallel`` or
    nothing, so that each test sees one rule at a time; the shaping tests lower it."""
    values = {
        "expected_calls": 8,
        "est_prompt_tokens": 200,
        "est_output_tokens": 50,
        "deadline_s": 300.0,
    }
    values.update(kw)
    return SessionNeed(
        tier=tier,
        max_parallel=parallel,
        expected_calls=int(values["expected_calls"]),
        est_prompt_tokens=int(values["est_prompt_tokens"]),
        est_output_tokens=int(values["est_output_tokens"]),
        deadline_s=values["deadline_s"],
        min_parallel=parallel if least is None else least,
    )


def run(
    n: SessionNeed | None = None,
    f: FleetSnapshot | None = None,
    h: Holdings | None = None,
    pressure: Pressure = Pressure.NORMAL,
    jitter: float = 0.5,
    policy: AdmissionPolicy = POLICY,
    factors: tuple[float, float, float] | None = None,
) -> tuple[Decision, Reason, int | None]:
    d = decide(
        n or need(),
        TENANT,
        f or fleet(),
        h or holdings(),
        pressure,
        policy,
        max_age_s=MAX_AGE_S,
        jitter=jitter,
        factors=factors,
    )
    return d.decision, d.reason, d.retry_after_s


def test_a_session_that_fits_is_admitted_with_its_peak_footprint_reserved() -> None:
    d = decide(
        need(parallel=4), TENANT, fleet(), holdings(), Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.0,
    )  # fmt: skip
    assert (d.decision, d.reason, d.retry_after_s) == (Decision.ADMIT, Reason.ADMITTED, None)
    assert d.reserve_tokens == 4 * 250
    assert d.tier_limits == (10_000, 8_000, 5_000)
    assert d.signals["capacity_tokens"] == 10_000


@pytest.mark.parametrize(
    "h",
    [
        holdings(sessions=3),  # concurrent sessions
        holdings(sessions=1, parallel=37),  # parallel calls: 37 + 4 > 40
        holdings(tokens=99_000),  # tokens per minute: 8 calls x 250 more than allowed
    ],
)
def test_tenant_over_its_quota_is_rejected_429_style(h: Holdings) -> None:
    decision, reason, retry = run(h=h)
    assert (decision, reason) == (Decision.REJECT, Reason.TENANT_QUOTA)
    assert retry is not None and 1 <= retry <= 60


def test_tokens_per_minute_retry_after_is_the_rest_of_the_minute() -> None:
    _, _, retry = run(h=holdings(tokens=99_000), jitter=0.5)
    assert retry == 18  # 17.5 s left, jitter factor 1.0


def test_no_live_worker_defers_and_a_stale_reading_is_not_capacity() -> None:
    assert run(f=FleetSnapshot((), None))[:2] == (Decision.DEFER, Reason.NO_WORKERS)
    stale = fleet(worker(age_s=MAX_AGE_S + 0.1, usage=0.0))
    assert run(f=stale)[:2] == (Decision.DEFER, Reason.NO_WORKERS)
    # A fresh worker plus a stale one: only the fresh one's capacity counts.
    mixed = fleet(worker("fresh", capacity=1_000), worker("stale", capacity=50_000, age_s=9))
    assert run(need(parallel=4), mixed)[:2] == (Decision.REJECT, Reason.EXCEEDS_CAPACITY)


def test_an_all_draining_fleet_defers_with_draining() -> None:
    assert run(f=fleet(worker(draining=True)))[:2] == (Decision.DEFER, Reason.DRAINING)


def test_a_session_larger_than_its_tier_could_ever_hold_is_rejected() -> None:
    # Best-effort may hold 50% of 10,000 tokens: 21 x 250 = 5,250 never fits.
    assert run(need(Tier.BESTEFFORT, parallel=21))[:2] == (
        Decision.REJECT,
        Reason.EXCEEDS_CAPACITY,
    )
    assert run(need(Tier.GUARANTEED, parallel=21))[:2] == (Decision.ADMIT, Reason.ADMITTED)


def test_learned_factors_let_reservations_exceed_the_cache_but_not_what_never_fits() -> None:
    # 10,000 tokens, standard may hold 80%: 7,500 reserved + 1,000 more does not fit at 1x...
    full = holdings(standard=7_500)
    assert run(need(parallel=4), h=full)[:2] == (Decision.DEFER, Reason.TIER_CAPACITY)
    # ...but does where the standard group's window learned that twice as much meets the
    # objectives.
    assert run(need(parallel=4), h=full, factors=(2.0, 2.0, 2.0))[:2] == (
        Decision.ADMIT,
        Reason.ADMITTED,
    )
    # Each group has its own factor: a narrow best-effort window does not hold standard back,
    # a narrow standard window does.
    assert run(need(parallel=4), h=full, factors=(2.0, 2.0, 1.0))[1] is Reason.ADMITTED
    assert run(need(parallel=4), h=full, factors=(2.0, 1.0, 1.0))[1] is Reason.TIER_CAPACITY
    # Whether a session could ever fit does not depend on what was learned: best-effort may
    # hold 5,000 tokens of this fleet, and 5,250 never fits, however the factors move.
    big = need(Tier.BESTEFFORT, parallel=21)
    assert run(big, factors=(4.0, 4.0, 4.0))[:2] == (Decision.REJECT, Reason.EXCEEDS_CAPACITY)
    # A learned factor below the operator's floor is not used.
    floor2 = replace(POLICY, kv_overcommit=2)
    assert run(need(parallel=4), h=full, factors=(0.5, 0.5, 0.5), policy=floor2)[:2] == (
        Decision.ADMIT,
        Reason.ADMITTED,
    )


def test_a_session_that_does_not_fit_as_declared_is_shaped_to_what_fits() -> None:
    # Standard holds 7,500 of its 8,000: two calls of 250 fit, not four.
    full = holdings(standard=7_500)
    d = decide(
        need(parallel=4, least=1), TENANT, fleet(), full, Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.0,
    )  # fmt: skip
    assert (d.decision, d.reason, d.granted_parallel) == (Decision.ADMIT, Reason.ADMITTED, 2)
    assert d.reserve_tokens == 2 * 250 and d.signals["granted_parallel"] == 2
    assert d.bound_group == 1  # the standard group's room shaped it: its window may grow
    # Not below what the session accepts: three at least do not fit, so it waits.
    assert run(need(parallel=4, least=3), h=full)[:2] == (Decision.DEFER, Reason.TIER_CAPACITY)
    # A session larger than its tier could ever hold is shaped too, not rejected: best-effort
    # may hold 5,000 tokens, 20 calls of 250.
    d = decide(
        need(Tier.BESTEFFORT, parallel=30, least=1), TENANT, fleet(), holdings(),
        Pressure.NORMAL, POLICY, max_age_s=MAX_AGE_S, jitter=0.0,
    )  # fmt: skip
    assert (d.decision, d.granted_parallel, d.bound_group) == (Decision.ADMIT, 20, None)
    assert run(need(Tier.BESTEFFORT, parallel=30, least=21))[1] is Reason.EXCEEDS_CAPACITY
    # Unshaped, the whole declared width is granted.
    d = decide(
        need(parallel=4, least=1), TENANT, fleet(), holdings(), Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.0,
    )  # fmt: skip
    assert d.granted_parallel == 4 and "granted_parallel" not in d.signals


def test_shaping_never_goes_below_what_the_deadline_needs() -> None:
    # 10 tokens/s per sequence, 50-token calls: 5 s each. 8 calls in 12 s need 2 rounds, so
    # at least 4 in flight. With room for 2 only (500 tokens), the session waits rather than
    # being admitted to miss its deadline; with room for 4 it is admitted with 4.
    f = fleet(worker(seq_tokens_per_s=10.0, running=2))
    tight = need(parallel=8, least=1, deadline_s=12)
    assert run(tight, f, h=holdings(standard=7_500))[:2] == (
        Decision.DEFER,
        Reason.TIER_CAPACITY,
    )
    d = decide(
        tight, TENANT, f, holdings(standard=7_000), Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.0,
    )  # fmt: skip
    assert (d.decision, d.granted_parallel) == (Decision.ADMIT, 4)
    # Shaped to what it could ever hold (20 calls), 100 calls of 5 s need 25 s: infeasible in 20.
    huge = need(Tier.BESTEFFORT, parallel=100, least=1, expected_calls=100, deadline_s=20)
    assert run(huge, f)[:2] == (Decision.REJECT, Reason.DEADLINE_INFEASIBLE)


def test_a_deferral_names_the_group_whose_room_bound_it() -> None:
    def bound(n: SessionNeed, h: Holdings) -> int | None:
        return decide(
            n, TENANT, fleet(), h, Pressure.NORMAL, POLICY, max_age_s=MAX_AGE_S, jitter=0.0
        ).bound_group

    assert bound(need(Tier.BESTEFFORT), holdings(besteffort=4_500)) == 2
    assert bound(need(Tier.STANDARD), holdings(standard=7_500)) == 1
    assert bound(need(Tier.GUARANTEED), holdings(guaranteed=9_500)) == 0
    assert bound(need(Tier.GUARANTEED), holdings()) is None


def test_a_deadline_the_session_cannot_meet_is_rejected_without_retry_after() -> None:
    # 10 tokens/s per sequence. 8 calls, 2 at a time, 50 tokens each: 4 rounds of 5 s = 20 s.
    f = fleet(worker(seq_tokens_per_s=10.0, running=2))
    decision, reason, retry = run(need(parallel=2, deadline_s=19), f)
    assert (decision, reason, retry) == (Decision.REJECT, Reason.DEADLINE_INFEASIBLE, None)
    assert run(need(parallel=2, deadline_s=21), f)[1] is Reason.ADMITTED
    assert run(need(parallel=8, deadline_s=6), f)[1] is Reason.ADMITTED  # one round


def test_the_pace_admitted_sessions_kept_rejects_a_session_left_too_little_deadline() -> None:
    # 8 calls, 2 at a time, 50 output tokens each: 4 rounds. Decoding alone at 10 tokens/s
    # takes 20 s; the sessions admitted lately took 0.2 s per round token (their waits and
    # their clients' tools included): 40 s.
    f = fleet(worker(seq_tokens_per_s=10.0, running=2))

    def paced(n: SessionNeed, pace: float | None) -> AdmissionDecision:
        return decide(
            n, TENANT, f, holdings(), Pressure.NORMAL, POLICY,
            max_age_s=MAX_AGE_S, jitter=0.5, session_pace_s=pace,
        )  # fmt: skip

    assert paced(need(parallel=2, deadline_s=30), None).reason is Reason.ADMITTED
    late = paced(need(parallel=2, deadline_s=30), 0.2)
    assert (late.decision, late.reason) == (Decision.REJECT, Reason.DEADLINE_INFEASIBLE)
    assert late.signals["session_pace_ms"] == 200.0
    assert paced(need(parallel=2, deadline_s=41), 0.2).reason is Reason.ADMITTED
    # Never faster than the fleet decodes: a pace below it leaves the fastest speed's bound.
    assert paced(need(parallel=2, deadline_s=19), 0.01).reason is Reason.DEADLINE_INFEASIBLE
    # A plain call waits for no tool between turns: its bound is the decode speed alone.
    call = replace(need(parallel=1, expected_calls=1, deadline_s=6), may_queue=True)
    assert paced(call, 0.2).reason is Reason.ADMITTED
    # With no decode speed observed yet, the pace alone bounds a session.
    idle = fleet(worker(seq_tokens_per_s=None, running=0))
    unobserved = decide(
        need(parallel=2, deadline_s=30), TENANT, idle, holdings(), Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.5, session_pace_s=0.2,
    )  # fmt: skip
    assert unobserved.reason is Reason.DEADLINE_INFEASIBLE


def test_with_no_observed_speed_no_deadline_is_rejected_on_a_guess() -> None:
    assert run(need(parallel=1, deadline_s=0.5))[1] is Reason.ADMITTED
    idle = fleet(worker(seq_tokens_per_s=None, running=0))
    assert run(need(parallel=1, deadline_s=0.5), idle)[1] is Reason.ADMITTED


@pytest.mark.parametrize(
    ("pressure", "tier", "reason"),
    [
        (Pressure.ELEVATED, Tier.BESTEFFORT, Reason.FLEET_SATURATED),
        (Pressure.ELEVATED, Tier.STANDARD, Reason.ADMITTED),
        (Pressure.SATURATED, Tier.STANDARD, Reason.FLEET_SATURATED),
        (Pressure.SATURATED, Tier.GUARANTEED, Reason.ADMITTED),
    ],
)
def test_pressure_shuts_out_lower_tiers_first(
    pressure: Pressure, tier: Tier, reason: Reason
) -> None:
    decision, got, retry = run(need(tier), pressure=pressure)
    assert got is reason
    assert (decision is Decision.DEFER) == (reason is Reason.FLEET_SATURATED)
    assert (retry is not None) == (decision is Decision.DEFER)


def test_nested_tier_shares_keep_the_top_of_the_fleet_for_higher_tiers() -> None:
    # Standard + best-effort may hold 8,000 of 10,000; best-effort alone 5,000.
    full_low = holdings(standard=3_500, besteffort=4_000)
    assert run(need(Tier.STANDARD), h=full_low)[:2] == (Decision.DEFER, Reason.TIER_CAPACITY)
    assert run(need(Tier.GUARANTEED), h=full_low)[:2] == (Decision.ADMIT, Reason.ADMITTED)
    be_full = holdings(besteffort=4_500)
    assert run(need(Tier.BESTEFFORT), h=be_full)[:2] == (Decision.DEFER, Reason.TIER_CAPACITY)
    assert run(need(Tier.STANDARD), h=be_full)[:2] == (Decision.ADMIT, Reason.ADMITTED)


def test_calls_queued_for_room_defer_sessions_whose_calls_would_queue_behind_them() -> None:
    def queued(tier: Tier, f: FleetSnapshot) -> tuple[Decision, Reason, int | None]:
        return run(need(tier), f=f)

    staged = fleet(replace(worker(), staged=1))
    # A worker starts guaranteed calls first: its staged calls hold back only lower tiers.
    assert queued(Tier.STANDARD, staged)[:2] == (Decision.DEFER, Reason.FLEET_SATURATED)
    assert queued(Tier.BESTEFFORT, fleet(worker(waiting=2)))[0] is Decision.DEFER
    assert queued(Tier.GUARANTEED, staged)[:2] == (Decision.ADMIT, Reason.ADMITTED)
    # In JetStream a call queues behind pending calls of its own tier and the tiers above it.
    pending_standard = fleet(pending=3)
    assert queued(Tier.GUARANTEED, pending_standard)[0] is Decision.ADMIT
    assert queued(Tier.STANDARD, pending_standard)[0] is Decision.DEFER
    assert queued(Tier.BESTEFFORT, pending_standard)[0] is Decision.DEFER
    d = decide(
        need(Tier.STANDARD), TENANT, staged, holdings(), Pressure.NORMAL, POLICY,
        max_age_s=MAX_AGE_S, jitter=0.5,
    )  # fmt: skip
    assert d.signals["queued_ahead"] == 1 and d.retry_after_s is not None
    # A stale worker's queue is not read (nor is its capacity: no worker is live).
    assert (
        queued(Tier.STANDARD, fleet(replace(worker(age_s=10), staged=5), worker("w2")))[0]
        is Decision.ADMIT
    )


def test_a_first_turn_that_the_workers_cannot_start_now_is_deferred() -> None:
    # 10,000 tokens of cache; the session's first turn is 4 x 250 = 1,000.
    def first_turn(committed: int, unseen: int = 0) -> AdmissionDecision:
        busy = FleetSnapshot(
            (replace(worker(usage=0.1), committed_tokens=committed),), {}, unseen_tokens=unseen
        )
        return decide(
            need(Tier.GUARANTEED), TENANT, busy, holdings(), Pressure.NORMAL, POLICY,
            max_age_s=MAX_AGE_S, jitter=0.5,
        )  # fmt: skip

    assert first_turn(9_000).decision is Decision.ADMIT
    assert first_turn(9_001).reason is Reason.FLEET_SATURATED
    # Sessions admitted since the reading will commit their reservations too.
    deferred = first_turn(8_000, unseen=1_500)
    assert (deferred.decision, deferred.reason) == (Decision.DEFER, Reason.FLEET_SATURATED)
    assert deferred.signals["uncommitted_tokens"] == 500
    assert deferred.bound_group is None  # not a reason for the windows to grow
    # A first turn that cannot start now is deferred even where the session accepts fewer
    # calls: a passing moment does not shape it for its whole life.
    half_busy = FleetSnapshot(
        (replace(worker(usage=0.1), committed_tokens=8_000),), {}, unseen_tokens=1_500
    )
    assert run(need(Tier.GUARANTEED, least=1), f=half_busy)[:2] == (
        Decision.DEFER,
        Reason.FLEET_SATURATED,
    )
    # One larger than the caches together could never start at once: shaped to what they hold
    # (4 x 250 asked, 600 tokens of cache, windows over-committed 4 times), or deferred where
    # the session takes nothing less.
    small = fleet(worker(capacity=600, usage=0.0))
    wide = replace(POLICY, kv_overcommit=4.0)
    shaped = decide(
        need(Tier.GUARANTEED, least=1), TENANT, small, holdings(), Pressure.NORMAL, wide,
        max_age_s=MAX_AGE_S, jitter=0.5,
    )  # fmt: skip
    assert (shaped.decision, shaped.granted_parallel) == (Decision.ADMIT, 2)
    assert shaped.bound_group is None
    assert run(need(Tier.GUARANTEED), f=small, policy=wide)[:2] == (
        Decision.DEFER,
        Reason.FLEET_SATURATED,
    )
    # A plain call may wait in the queue instead, bounded by its own deadline.
    call = replace(need(Tier.STANDARD, 1), may_queue=True)
    queued = FleetSnapshot(
        (replace(worker(usage=0.1), committed_tokens=10_000, staged=3),), {Tier.STANDARD: 5}
    )
    assert run(call, f=queued)[:2] == (Decision.ADMIT, Reason.ADMITTED)
    assert run(replace(call, may_queue=False), f=queued)[0] is Decision.DEFER
    # What the engine holds counts where it is more than the workers' predicted peak.
    assert first_turn(0).decision is Decision.ADMIT
    full_engine = FleetSnapshot((worker(usage=0.95),), {})
    assert run(need(Tier.GUARANTEED), f=full_engine)[:2] == (
        Decision.DEFER,
        Reason.FLEET_SATURATED,
    )


def test_a_queue_or_a_first_turn_that_cannot_start_asks_back_after_one_call() -> None:
    # Calls of 50 output tokens; the fastest sequence decodes 25 tokens/s: calls in flight
    # end within 2 s, so the session is asked back then, not after the 5 s default.
    def retry_after(f: FleetSnapshot) -> int | None:
        decision, reason, retry = run(need(Tier.STANDARD), f=f, jitter=0.5)
        assert (decision, reason) == (Decision.DEFER, Reason.FLEET_SATURATED)
        return retry

    speed = 25.0
    staged = fleet(replace(worker(seq_tokens_per_s=speed), staged=1))
    committed = fleet(replace(worker(seq_tokens_per_s=speed), committed_tokens=9_500))
    assert retry_after(staged) == retry_after(committed) == 2  # 50 / 25 s, jitter 1.0
    # A fleet that has shown no speed yet: the default.
    unmeasured = fleet(replace(worker(), committed_tokens=9_500))
    assert retry_after(unmeasured) == POLICY.default_retry_after_s == 5
    # A fleet reserved full is asked back by its release rate, as before.
    full = holdings(guaranteed=9_500, release_rate=100.0)
    assert run(need(Tier.GUARANTEED), f=committed, h=full, jitter=0.0)[2] == 4


def test_a_full_fleet_defers_guaranteed_with_fleet_saturated() -> None:
    full = holdings(guaranteed=9_500)
    assert run(need(Tier.GUARANTEED), h=full)[:2] == (Decision.DEFER, Reason.FLEET_SATURATED)


def test_retry_after_follows_the_release_rate_with_jitter_and_bounds() -> None:
    full = holdings(guaranteed=9_500, release_rate=100.0)  # shortfall 500 tokens: ~5 s
    assert run(need(Tier.GUARANTEED), h=full, jitter=0.0)[2] == 4  # 5 x 0.8
    assert run(need(Tier.GUARANTEED), h=full, jitter=0.999)[2] == 6  # 5 x 1.2
    crawling = replace(full, released_tokens_per_s=0.5)
    assert run(need(Tier.GUARANTEED), h=crawling)[2] == 60
    racing = replace(full, released_tokens_per_s=1e9)
    assert run(need(Tier.GUARANTEED), h=racing)[2] == 1


def test_overcommit_scales_capacity() -> None:
    wide = replace(POLICY, kv_overcommit=4.0)
    assert run(need(Tier.BESTEFFORT, parallel=21), policy=wide)[1] is Reason.ADMITTED


def test_fleet_load_is_kv_usage_or_backlog_and_unknown_without_fresh_workers() -> None:
    assert fleet_load(fleet(worker(usage=0.4)), MAX_AGE_S) == pytest.approx(0.4)
    # 16 slots: 48 calls pending is 1.5 batches of 2.
    assert fleet_load(fleet(worker(usage=0.4), pending=48), MAX_AGE_S) == pytest.approx(1.5)
    assert fleet_load(fleet(worker(age_s=10)), MAX_AGE_S) is None


def test_the_fleet_has_room_only_with_little_committed_and_nothing_queued_anywhere() -> None:
    def room(*workers: WorkerReading, pending: int = 0) -> bool:
        return fleet_has_room(fleet(*workers, pending=pending), MAX_AGE_S, below=0.5)

    assert room(worker(usage=0.2), worker("w2", usage=0.6))  # 4,000 of 10,000 tokens
    assert not room(worker(usage=0.2), worker("w2", usage=0.9))
    # The predicted peak counts, not only what the engine holds now.
    assert not room(replace(worker(usage=0.1), committed_tokens=6_000))
    assert room(replace(worker(usage=0.1), committed_tokens=4_000))
    # Anything waiting, at a worker or in JetStream, is no room, however empty the cache.
    assert not room(worker(usage=0.1, waiting=1))
    assert not room(replace(worker(usage=0.1), staged=1))
    assert not room(worker(usage=0.1), pending=1)
    # Unknown is never room.
    assert not room(worker(age_s=10))
    assert not fleet_has_room(FleetSnapshot((worker(),), None), MAX_AGE_S, below=0.5)
    assert not room(worker(draining=True))


def test_how_busy_the_fleet_is_counts_each_workers_committed_or_held_kv() -> None:
    # 1,000 + 6,000 (committed beyond what it holds) + 0 of a draining worker's: of 20,000.
    busy = fleet_busy(
        fleet(
            worker(usage=0.1),
            replace(worker("w2", usage=0.2), committed_tokens=6_000),
            worker("w3", usage=0.9, draining=True),
        ),
        MAX_AGE_S,
    )
    assert busy == pytest.approx(7_000 / 20_000)
    # Held beyond its commitment (a call longer than predicted): what it holds.
    held = replace(worker(usage=0.5), committed_tokens=2_000)
    assert fleet_busy(fleet(held), MAX_AGE_S) == pytest.approx(0.5)
    assert fleet_busy(fleet(worker(age_s=10)), MAX_AGE_S) is None  # unknown, not idle


def test_pressure_escalates_only_after_consecutive_readings() -> None:
    tracker = PressureTracker(PressureBands(confirm_readings=3))
    assert [tracker.observe(x) for x in (0.9, 0.9, 0.5, 0.9, 0.9)] == [Pressure.NORMAL] * 5
    assert tracker.observe(0.9) is Pressure.ELEVATED
    for _ in range(2):
        assert tracker.observe(1.2) is Pressure.ELEVATED
    assert tracker.observe(1.2) is Pressure.SATURATED


def test_pressure_recovers_only_below_the_lower_band_one_level_at_a_time() -> None:
    tracker = PressureTracker(PressureBands(confirm_readings=2))
    for x in (0.9, 0.9, 1.1, 1.1):
        tracker.observe(x)
    assert tracker.state is Pressure.SATURATED
    # 0.9 is under the saturate band (1.0) but above its recovery band (0.85): no change.
    assert [tracker.observe(0.9) for _ in range(5)] == [Pressure.SATURATED] * 5
    assert [tracker.observe(0.75) for _ in range(2)] == [Pressure.SATURATED, Pressure.ELEVATED]
    # 0.75 is above the elevated recovery band (0.7): stays elevated however long it lasts.
    assert [tracker.observe(0.75) for _ in range(5)] == [Pressure.ELEVATED] * 5
    assert [tracker.observe(0.3) for _ in range(2)] == [Pressure.ELEVATED, Pressure.NORMAL]


def test_a_load_hovering_at_a_threshold_does_not_flap() -> None:
    tracker = PressureTracker(PressureBands(confirm_readings=3))
    states = [tracker.observe(x) for x in [0.84, 0.86] * 20]
    assert set(states) == {Pressure.NORMAL}
    for _ in range(3):
        tracker.observe(0.9)
    states = [tracker.observe(x) for x in [0.84, 0.86, 0.72, 0.8] * 10]
    assert set(states) == {Pressure.ELEVATED}


def test_a_missing_reading_keeps_the_state() -> None:
    tracker = PressureTracker(PressureBands(confirm_readings=1))
    tracker.observe(0.95)
    assert tracker.observe(None) is Pressure.ELEVATED


def test_every_refusal_reason_is_an_error_code_with_an_http_status() -> None:
    from api.errors import STATUS_BY_CODE
    from schemas.vocab import ErrorCode

    refusals = [r for r in Reason if r not in (Reason.ADMITTED, Reason.ADMITTED_DEGRADED)]
    assert {STATUS_BY_CODE[r.error_code] for r in refusals} == {429, 503}
    assert set(STATUS_BY_CODE) == set(ErrorCode)


def test_recent_admissions_count_the_tokens_a_reading_cannot_show_yet() -> None:
    from broker.admission.admitter import RecentAdmissions

    recent = RecentAdmissions()
    recent.add("a", 1_000, 300)
    recent.add("b", 1_100, 200)
    recent.add("c", 1_200, 100)
    assert recent.tokens_since(0) == 600
    recent.drop("b")  # released: commits nothing more
    recent.drop("b")  # twice is harmless
    assert recent.tokens_since(0) == 400
    assert recent.tokens_since(1_050) == 100  # "a" is older than the reading: seen, forgotten
    assert recent.tokens_since(0) == 100  # and does not come back
    recent.add("c", 1_300, 50)  # the same session again counts once
    assert recent.tokens_since(0) == 50
