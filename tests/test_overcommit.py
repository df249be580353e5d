"""Measured over-commit: learned from demand against reservations, within its bounds, never from
fresh reservations nobody has used yet, never rising under pressure."""

from __future__ import annotations

import pytest

from broker.admission import FleetSnapshot, Pressure, WorkerReading
from broker.overcommit import OvercommitBounds, OvercommitEstimator, fleet_demand
from schemas.vocab import Tier

BOUNDS = OvercommitBounds(floor=1.0, ceiling=4.0, target_use=0.8, window_s=30, min_evidence_s=10)


def feed(
    est: OvercommitEstimator,
    seconds: float,
    *,
    reserved: int,
    demand: float | None,
    start: float = 0.0,
    pressure: Pressure = Pressure.NORMAL,
) -> float:
    t = start
    while t <= start + seconds:
        est.observe(t, reserved=reserved, demand=demand, pressure=pressure)
        t += 0.5
    return est.value


def test_fresh_reservations_nobody_used_yet_are_not_slack() -> None:
    # A session admitted a moment ago has not started its calls: demand 0. Until reservations
    # have been held for min_evidence_s, the factor stays at the floor.
    est = OvercommitEstimator(BOUNDS)
    assert feed(est, 9.0, reserved=2000, demand=0) == 1.0
    assert est.ratio is None


def test_sessions_using_a_fifth_of_their_reservation_raise_the_factor_slowly() -> None:
    est = OvercommitEstimator(BOUNDS)
    feed(est, 10.0, reserved=1000, demand=200)
    assert est.ratio == pytest.approx(0.2)
    first = est.value
    assert 1.0 < first < 4.0  # slow start: at most 0.2 per second from the first evidence
    # Given time, it settles where expected demand is target_use of capacity: 0.8 / 0.2 = 4.
    assert feed(est, 30.0, reserved=1000, demand=200, start=10.5) == pytest.approx(4.0)


def test_the_factor_is_target_use_over_the_measured_ratio() -> None:
    est = OvercommitEstimator(BOUNDS)
    assert feed(est, 60.0, reserved=1000, demand=400) == pytest.approx(2.0)


def test_demand_above_the_reservations_brings_the_factor_down_at_once() -> None:
    est = OvercommitEstimator(BOUNDS)
    feed(est, 40.0, reserved=1000, demand=200)
    assert est.value == pytest.approx(4.0)
    # Calls queue up (demand counts them): the window's ratio climbs and the factor follows
    # down within a tick of the ratio, never slowly.
    before = est.value
    est.observe(41.0, reserved=1000, demand=20_000, pressure=Pressure.NORMAL)
    assert est.value < before
    assert feed(est, 30.0, reserved=1000, demand=1500, start=41.5) == 1.0


def test_under_pressure_the_factor_may_fall_but_not_rise() -> None:
    est = OvercommitEstimator(BOUNDS)
    assert feed(est, 60.0, reserved=1000, demand=200, pressure=Pressure.ELEVATED) == 1.0
    est = OvercommitEstimator(BOUNDS)
    feed(est, 60.0, reserved=1000, demand=400)
    assert est.value == pytest.approx(2.0)
    feed(est, 30.0, reserved=1000, demand=200, start=60.5, pressure=Pressure.SATURATED)
    assert est.value == pytest.approx(2.0)


def test_unknown_demand_teaches_nothing_and_an_idle_window_returns_to_the_floor() -> None:
    est = OvercommitEstimator(BOUNDS)
    assert feed(est, 60.0, reserved=1000, demand=None) == 1.0
    est = OvercommitEstimator(BOUNDS)
    feed(est, 60.0, reserved=1000, demand=200)
    assert est.value == pytest.approx(4.0)
    # Nothing reserved for a whole window: nothing left to learn from.
    assert feed(est, 31.0, reserved=0, demand=0, start=60.5) == 1.0


def test_floor_equal_to_ceiling_turns_learning_off() -> None:
    est = OvercommitEstimator(OvercommitBounds(floor=1.5, ceiling=1.5))
    assert feed(est, 60.0, reserved=1000, demand=10) == 1.5


def reading(
    worker_id: str = "w1",
    *,
    committed: int | None = 600,
    running: int = 3,
    waiting: int = 0,
    staged: int = 0,
    age_s: float = 0.5,
    draining: bool = False,
) -> WorkerReading:
    return WorkerReading(
        worker_id=worker_id,
        kv_usage=0.25,
        kv_capacity_tokens=4000,
        running=running,
        waiting=waiting,
        max_num_seqs=16,
        seq_tokens_per_s=None,
        age_s=age_s,
        draining=draining,
        committed_tokens=committed,
        staged=staged,
    )


def test_demand_is_what_running_calls_hold_plus_what_queued_calls_will_need() -> None:
    # 600 tokens over 3 running calls: 200 per call; 2 staged, 1 waiting, 4 pending in
    # JetStream: 7 queued calls of 200.
    fleet = FleetSnapshot((reading(staged=2, waiting=1),), {Tier.STANDARD: 3, Tier.BESTEFFORT: 1})
    assert fleet_demand(fleet, max_age_s=6) == 600 + 7 * 200
    # Stale and draining workers are not the fleet that serves new sessions.
    stale = FleetSnapshot((reading(), reading("w2", age_s=10), reading("w3", draining=True)), None)
    assert fleet_demand(stale, max_age_s=6) == 600
    assert fleet_demand(FleetSnapshot((reading(age_s=10),), None), max_age_s=6) is None
    # An older worker without a committed count: its KV usage stands in (0.25 of 4,000).
    old = FleetSnapshot((reading(committed=None),), None)
    assert fleet_demand(old, max_age_s=6) == 1000
    # Nothing running yet, calls queued: each costs a full slot's share of the cache.
    idle = FleetSnapshot((reading(committed=0, running=0),), {Tier.STANDARD: 2})
    assert fleet_demand(idle, max_age_s=6) == 2 * 4000 / 16
