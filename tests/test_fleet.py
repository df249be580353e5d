"""The front door's fleet view: liveness by heartbeat age, and the per-sequence decode speed
that deadline checks rely on."""

from __future__ import annotations

import pytest

from broker.fleet import SPEED_SPAN_MS, SPEED_WINDOW_MS, FleetView
from schemas.wire import WorkerHeartbeat, encode


def beat(sent_ms: int, generated: int, running: int, worker: str = "w1") -> bytes:
    return encode(
        WorkerHeartbeat(
            worker_id=worker,
            model="kvgate-dev",
            sent_ms=sent_ms,
            kv_cache_usage=0.1,
            num_running=running,
            num_waiting=0,
            max_num_seqs=16,
            kv_capacity_tokens=2048,
            generated_tokens=generated,
        )
    )


def test_speed_per_sequence_comes_from_intervals_busy_at_both_ends() -> None:
    view = FleetView(max_age_s=6)
    view.update("w1", beat(0, 0, running=0))
    # A call started just before this heartbeat: 5 tokens over an interval that was idle for
    # most of its length. Read as a speed, it would be a crawl; it is not counted.
    view.update("w1", beat(2000, 5, running=1))
    assert view.seq_tokens_per_s("w1") is None
    # Busy at both ends: 1.5 sequences on average, 1,200 tokens in 2 s -> 400 tokens/s each.
    view.update("w1", beat(4000, 1205, running=2))
    assert view.seq_tokens_per_s("w1") == pytest.approx(400)
    view.update("w1", beat(6000, 1805, running=2))
    # The fastest recent reading stands: a slower, busier interval does not lower it.
    assert view.seq_tokens_per_s("w1") == pytest.approx(400)
    # Idle afterwards: no new readings, the recent fastest is kept.
    view.update("w1", beat(8000, 1805, running=0))
    assert view.seq_tokens_per_s("w1") == pytest.approx(400)


def test_a_busy_worker_beating_often_is_measured_over_spans_not_each_beat() -> None:
    # A busy worker beats on every call it starts or ends (``reading_interval_s``). One beat
    # 250 ms after another, with one more sequence running at its end, would read as
    # 2 x 100 / 0.25 / 1.5 = 533 tokens/s a sequence; over the span it is 200.
    view = FleetView(max_age_s=6)
    view.update("w1", beat(0, 0, running=1))
    view.update("w1", beat(250, 100, running=2))
    view.update("w1", beat(1000, 300, running=1))
    assert view.seq_tokens_per_s("w1") is None  # under SPEED_SPAN_MS: not measured yet
    view.update("w1", beat(SPEED_SPAN_MS, 300, running=1))
    assert view.seq_tokens_per_s("w1") == pytest.approx(300 / (SPEED_SPAN_MS / 1000))
    # The next span begins where this one ended.
    view.update("w1", beat(SPEED_SPAN_MS + 1000, 600, running=1))
    view.update("w1", beat(2 * SPEED_SPAN_MS, 1200, running=1))
    assert view.seq_tokens_per_s("w1") == pytest.approx(900 / (SPEED_SPAN_MS / 1000))


def test_old_speed_readings_age_out_and_a_restart_is_not_a_negative_speed() -> None:
    view = FleetView(max_age_s=6)
    view.update("w1", beat(0, 0, running=1))
    view.update("w1", beat(2000, 2000, running=1))
    assert view.seq_tokens_per_s("w1") == pytest.approx(1000)
    later = SPEED_WINDOW_MS + 5000
    view.update("w1", beat(later, 2100, running=1))
    view.update("w1", beat(later + 2000, 2500, running=1))
    assert view.seq_tokens_per_s("w1") == pytest.approx(200)  # the 1,000 tokens/s aged out
    view.update("w1", beat(later + 4000, 10, running=1))  # restarted: its counter began again
    assert view.seq_tokens_per_s("w1") == pytest.approx(200)
    # Measured again from the restart on.
    view.update("w1", beat(later + 6000, 510, running=1))
    assert view.seq_tokens_per_s("w1") == pytest.approx(250)


def test_a_deleted_worker_is_gone_with_its_speed() -> None:
    view = FleetView(max_age_s=6)
    view.update("w1", beat(0, 0, running=1))
    view.update("w1", beat(1000, 300, running=1))
    view.update("w1", None)
    assert view.all() == []
    assert view.seq_tokens_per_s("w1") is None


def test_a_stale_heartbeat_is_not_a_live_worker() -> None:
    view = FleetView(max_age_s=6)
    view.update("w1", beat(0, 0, running=0))
    assert [hb.worker_id for hb in view.live(6000)] == ["w1"]
    assert view.live(6001) == []
