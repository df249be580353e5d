"""The harness's metrics on small hand-made outcome sets, where every number can be checked by
hand: refused work in the denominator, wasted tokens, percentiles, capacity search."""

from __future__ import annotations

import pytest

from loadtests.agent import CallOutcome, CallStatus, SessionOutcome
from loadtests.capacity import CapacitySearch
from loadtests.metrics import Objectives, spread, summarize
from loadtests.sweep import signals_moved, targets
from loadtests.targets import Sample

OBJ = Objectives.same(ttft_s=0.5, tpot_s=0.02)


def call(
    session: str,
    i: int,
    status: CallStatus = CallStatus.OK,
    ttft: float | None = 0.1,
    tpot: float | None = 0.01,
    tokens: int = 10,
    retries: int = 0,
) -> CallOutcome:
    ok = status is CallStatus.OK
    return CallOutcome(
        session_id=session,
        call_id=f"{session}-c{i}",
        tier="standard",
        status=status,
        ttft_s=ttft if ok or status is CallStatus.ABANDONED else None,
        tpot_s=tpot if ok else None,
        completion_tokens=tokens,
        retries=retries,
    )


def session(
    sid: str, calls: list[CallOutcome], *, tier: str = "standard", **fields: object
) -> SessionOutcome:
    for c in calls:
        c.tier = tier
    out = SessionOutcome(
        session_id=sid, tier=tier, client="polite", arrival_s=0, deadline_s=10, calls=calls
    )
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_a_call_meets_its_objectives_only_when_complete_and_within_both() -> None:
    assert OBJ.met(call("s", 0))
    assert OBJ.met(call("s", 0, ttft=0.5, tpot=0.02))  # at the objective is within it
    assert not OBJ.met(call("s", 0, ttft=0.51))
    assert not OBJ.met(call("s", 0, tpot=0.03))
    assert OBJ.met(call("s", 0, tpot=None))  # a one-token answer has no TPOT
    assert not OBJ.met(call("s", 0, status=CallStatus.FAILED))
    assert not OBJ.met(call("s", 0, status=CallStatus.ABANDONED, ttft=0.1))


def test_refused_sessions_and_their_unsent_calls_count_in_the_denominators() -> None:
    good = session("a", [call("a", 0), call("a", 1)])
    refused = session(
        "b",
        [call("b", 0, status=CallStatus.NOT_SENT, tokens=0)] * 3,
        admitted=False,
        refusal_code="fleet_saturated",
        deferrals=2,
        session_retries=1,
    )
    summary = summarize([good, refused], OBJ, window_s=4.0)
    assert summary["sessions_offered"] == 2
    assert summary["sessions_good"] == 1
    assert summary["session_goodput_fraction"] == 0.5
    assert summary["admitted_good_fraction"] == 1.0  # the refused one was never admitted
    assert summary["session_goodput_per_s"] == 0.25
    assert summary["calls_offered"] == 5
    assert summary["call_goodput"] == pytest.approx(2 / 5)
    assert summary["refusal_rate"] == 0.5
    assert summary["refusal_codes"] == {"fleet_saturated": 1}
    assert summary["defer_rate"] == 0.5
    assert summary["retries_sent"] == 1


def test_wasted_tokens_are_those_of_sessions_that_were_not_good() -> None:
    good = session("a", [call("a", 0, tokens=30), call("a", 1, tokens=20)])
    slow = session("b", [call("b", 0, tokens=40), call("b", 1, ttft=2.0, tokens=10)])
    cut = session(
        "c",
        [call("c", 0, tokens=25), call("c", 1, status=CallStatus.ABANDONED, tokens=5)],
        deadline_missed=True,
    )
    # From what the clients received: 50 good of 130.
    by_client = summarize([good, slow, cut], OBJ, window_s=1.0)
    assert by_client["tokens_generated_source"] == "client"
    assert by_client["tokens_generated"] == 130
    assert by_client["tokens_good"] == 50
    assert by_client["wasted_token_share"] == pytest.approx(80 / 130)
    # The engine's counter, when read, is the denominator (it saw tokens no client received).
    by_engine = summarize([good, slow, cut], OBJ, window_s=1.0, generated_tokens=200)
    assert by_engine["tokens_generated_source"] == "engine"
    assert by_engine["wasted_token_share"] == pytest.approx(150 / 200)
    # Only good sessions: nothing wasted.
    assert summarize([good], OBJ, window_s=1.0)["wasted_token_share"] == 0


def test_a_session_past_its_deadline_is_not_good_even_if_its_calls_were() -> None:
    late = session("a", [call("a", 0)], deadline_missed=True)
    assert not OBJ.good(late)
    assert summarize([late], OBJ, window_s=1.0)["sessions_good"] == 0


def test_latency_percentiles_per_tier_use_completed_calls_only() -> None:
    fast = session("g", [call("g", i, ttft=0.01 * (i + 1)) for i in range(10)], tier="guaranteed")
    failed = session("b", [call("b", 0, status=CallStatus.FAILED, ttft=None)], tier="besteffort")
    summary = summarize([fast, failed], OBJ, window_s=1.0)
    g = summary["by_tier"]["guaranteed"]
    # 0.01 .. 0.10 s, interpolated (loadtests.stats): p95 sits at rank 8.55 of 0..9.
    assert g["ttft_s"] == {"n": 10, "p50": 0.055, "p95": 0.0955, "p99": 0.0991}
    assert g["ttft_met_share_of_completed"] == 1.0
    assert summary["by_tier"]["besteffort"]["ttft_s"]["n"] == 0
    assert summary["by_tier"]["besteffort"]["ttft_met_share_of_completed"] is None


def test_spread_over_repeats_leaves_out_empty_points() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert spread([4.0, 2.0]) == {"min": 2.0, "median": 3.0, "max": 4.0, "n": 2}
    assert spread([None]) == {"min": None, "median": None, "max": None, "n": 0}


def test_signals_moved_tells_a_flat_signal_from_a_moving_one() -> None:
    samples = [
        Sample(t_s=0, kv_usage=0.1, running=2, waiting=0, pending=None),
        Sample(t_s=1, kv_usage=0.9, running=2, waiting=0, pending=None),
    ]
    moved = signals_moved(samples)
    assert moved["kv_usage"] == {"min": 0.1, "max": 0.9, "moved": True}
    assert moved["running"]["moved"] is False
    assert moved["pending"] == {"min": None, "max": None, "moved": False}


def test_targets_compare_against_kvgates_own_peak_and_direct() -> None:
    def agg(goodput: float, wasted: float, tok_s: float, guaranteed: float) -> dict[str, object]:
        return {
            "session_goodput_per_s": {"median": goodput},
            "wasted_token_share": {"median": wasted},
            "output_tokens_per_s": {"median": tok_s},
            "ttft_met_share_by_tier": {"guaranteed": {"median": guaranteed}},
        }

    by_mode = {
        "direct": {"1": agg(1.0, 0, 1000, 1), "2": agg(0.2, 0.8, 1000, 0.5)},
        "kvgate-call": {"1": agg(0.8, 0.1, 950, 1), "2": agg(0.5, 0.4, 950, 0.9)},
        "kvgate-session": {"1": agg(1.0, 0, 800, 1), "2": agg(0.95, 0.03, 850, 1.0)},
    }
    result = targets(by_mode, (1.0, 2.0))
    assert result["session_goodput_2x_vs_peak"]["measured"] == pytest.approx(0.95)
    assert result["session_goodput_2x_vs_peak"]["met"] is True
    assert result["session_goodput_4x_vs_peak"]["met"] is None  # not measured
    assert result["wasted_tokens_2x"]["met"] is True
    assert result["guaranteed_ttft_met_2x"]["measured"] == 1.0
    assert result["throughput_efficiency_kvgate-session_2x"]["measured"] == pytest.approx(0.85)
    assert result["throughput_efficiency_kvgate-session_2x"]["met"] is False


async def test_capacity_is_the_highest_rate_that_holds() -> None:
    # Good share falls off past 2.6 sessions/s.
    async def probe(rate: float, repeat: int) -> float:
        return 1.0 if rate <= 2.6 else 0.5

    search = CapacitySearch(start=1.0, step=1.5)
    capacity = await search.run(probe)
    tried = [round(r, 3) for r, _ in search.probes]
    # 1 -> 1.5 -> 2.25 hold, 3.375 fails, then once between 2.25 and 3.375 (2.756: fails).
    assert tried == [1.0, 1.5, 2.25, 3.375, 2.756]
    assert capacity == pytest.approx(2.25)


async def test_capacity_search_steps_down_when_the_first_rate_fails() -> None:
    async def probe(rate: float, repeat: int) -> float:
        return 0.95 if rate <= 0.3 else 0.1

    search = CapacitySearch(start=1.0, step=2.0)
    capacity = await search.run(probe)
    assert [r for r, _ in search.probes] == [1.0, 0.5, 0.25, pytest.approx(0.3536, abs=1e-3)]
    assert capacity == 0.25


async def test_capacity_search_gives_up_after_its_probes() -> None:
    async def probe(rate: float, repeat: int) -> float:
        return 0.0

    search = CapacitySearch(start=1.0, step=2.0, max_probes=3)
    assert await search.run(probe) == 0.25
    assert len(search.probes) == 3


async def test_a_rate_holds_where_most_of_its_traces_do() -> None:
    """One lucky trace does not pass a rate: each rate runs up to ``repeats`` traces (the
    sweep's own seeds) and holds where most of them held, stopping once that is decided."""
    # Trace 0 is lucky up to 2.25/s; traces 1 and 2 hold only up to 1.5/s.
    limits = {0: 2.3, 1: 1.6, 2: 1.6}
    runs: list[tuple[float, int]] = []

    async def probe(rate: float, repeat: int) -> float:
        runs.append((round(rate, 3), repeat))
        return 1.0 if rate <= limits[repeat] else 0.4

    search = CapacitySearch(start=1.0, step=1.5, repeats=3)
    assert await search.run(probe) == pytest.approx(1.5)
    assert [round(r, 3) for r, _ in search.probes] == [1.0, 1.5, 2.25, 1.837]
    # 1.0 and 1.5 held on their first two traces (most of three: the third is not run);
    # 2.25 and the middle (1.837) held on the lucky trace only.
    assert search.shares == [(1.0, 1.0), (1.0, 1.0), (1.0, 0.4, 0.4), (1.0, 0.4, 0.4)]
    assert [share for _, share in search.probes] == [1.0, 1.0, 0.4, 0.4]
    assert runs[:2] == [(1.0, 0), (1.0, 1)]
    # One trace a rate, as before: the lucky trace alone would have passed 2.25/s.
    lucky = CapacitySearch(start=1.0, step=1.5)
    assert await lucky.run(probe) == pytest.approx(2.25)
    with pytest.raises(ValueError, match="at least one trace"):
        CapacitySearch(start=1.0, repeats=0)
