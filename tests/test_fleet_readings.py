"""The workers' readings that admission decides on (``FleetSignals.readings``): built once for
the decisions of the next ``READINGS_REUSE_MS``, never younger than they are, and rebuilt at
once when a worker joins, leaves, drains or changes model."""

from __future__ import annotations

import pytest

from broker.admission.signals import READINGS_REUSE_MS, FleetSignals
from broker.fleet import FleetView
from schemas.wire import WorkerHeartbeat, encode

MAX_AGE_S = 6.0
T0 = 1_000_000


def beat(worker: str, sent_ms: int, *, usage: float = 0.1, draining: bool = False) -> bytes:
    return encode(
        WorkerHeartbeat(
            worker_id=worker,
            model="kvgate-dev",
            sent_ms=sent_ms,
            kv_cache_usage=usage,
            num_running=0,
            num_waiting=0,
            max_num_seqs=16,
            kv_capacity_tokens=2048,
            draining=draining,
        )
    )


def signals_with(*beats: tuple[str, bytes]) -> FleetSignals:
    view = FleetView(MAX_AGE_S)
    for key, value in beats:
        view.update(key, value)
    return FleetSignals(view)


def test_a_refreshed_reading_is_seen_within_the_reuse_window() -> None:
    signals = signals_with(("w1", beat("w1", T0)))
    assert [w.kv_usage for w in signals.readings(T0 + 1000)] == [0.1]
    signals.fleet.update("w1", beat("w1", T0 + 1001, usage=0.9))
    # Within the window the decision reads the readings built for it, at most this much older.
    assert [w.kv_usage for w in signals.readings(T0 + 1000 + READINGS_REUSE_MS - 1)] == [0.1]
    assert [w.kv_usage for w in signals.readings(T0 + 1000 + READINGS_REUSE_MS)] == [0.9]


def test_a_reused_reading_is_never_younger_than_it_is() -> None:
    """Around the staleness bound, every decision sees an age at least the true one: a worker
    whose heartbeat is older than ``MAX_AGE_S`` is never counted live."""
    signals = signals_with(("w1", beat("w1", T0)))
    bound_ms = int(MAX_AGE_S * 1000)
    for now_ms in range(T0 + bound_ms - 3 * READINGS_REUSE_MS, T0 + bound_ms + 30):
        (reading,) = signals.readings(now_ms)
        assert reading.age_s >= (now_ms - T0) / 1000
        if now_ms - T0 > bound_ms:
            assert reading.age_s > MAX_AGE_S


@pytest.mark.parametrize("change", ["joins", "leaves", "drains"])
def test_who_is_in_the_fleet_is_current_at_the_next_decision(change: str) -> None:
    signals = signals_with(("w1", beat("w1", T0)), ("w2", beat("w2", T0)))
    assert len(signals.readings(T0 + 100)) == 2
    if change == "joins":
        signals.fleet.update("w3", beat("w3", T0 + 101))
    elif change == "leaves":
        signals.fleet.update("w2", None)
    else:
        signals.fleet.update("w2", beat("w2", T0 + 101, draining=True))
    readings = {w.worker_id: w for w in signals.readings(T0 + 102)}
    expected = {"joins": {"w1", "w2", "w3"}, "leaves": {"w1"}, "drains": {"w1", "w2"}}[change]
    assert set(readings) == expected
    if change == "drains":
        assert readings["w2"].draining
