"""The agent-session trace generator: deterministic for a seed, shaped as specified, and
replayable from its JSONL."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.workload import (
    ClientKind,
    LengthDist,
    WorkloadSpec,
    dump_jsonl,
    generate,
    load_jsonl,
    unloaded_duration_s,
)
from schemas.vocab import Tier

SPEC = WorkloadSpec()


def test_the_same_seed_gives_the_same_trace_byte_for_byte(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    dump_jsonl(generate(SPEC, rate=2.0, duration_s=30, seed=11), first)
    dump_jsonl(generate(SPEC, rate=2.0, duration_s=30, seed=11), second)
    assert first.read_bytes() == second.read_bytes()
    assert first.stat().st_size > 0


def test_another_seed_gives_another_trace() -> None:
    a = generate(SPEC, rate=2.0, duration_s=30, seed=11)
    b = generate(SPEC, rate=2.0, duration_s=30, seed=12)
    assert [s.arrival_s for s in a] != [s.arrival_s for s in b]


def test_a_trace_replays_from_its_jsonl(tmp_path: Path) -> None:
    trace = generate(SPEC, rate=1.0, duration_s=20, seed=3)
    path = tmp_path / "trace.jsonl"
    dump_jsonl(trace, path)
    assert load_jsonl(path) == trace


def test_sessions_have_the_specified_shape() -> None:
    trace = generate(SPEC, rate=5.0, duration_s=60, seed=5)
    assert len(trace) > 200
    arrivals = [s.arrival_s for s in trace]
    assert arrivals == sorted(arrivals)
    assert all(0 <= t < 60 for t in arrivals)
    for session in trace:
        calls = session.calls
        assert SPEC.calls_per_session[0] <= len(calls) <= SPEC.calls_per_session[1]
        assert len({c.call_id for c in calls}) == len(calls)
        for turn in session.turns:
            assert 1 <= len(turn.calls) <= SPEC.fanout[1]
            # A turn's calls are a burst: the first at once, the others within the window.
            assert turn.calls[0].offset_s == 0
            assert all(0 <= c.offset_s <= SPEC.burst_window_s for c in turn.calls)
        assert session.turns[0].think_s == 0
        for call in calls:
            assert SPEC.prompt.low <= call.prompt_tokens <= SPEC.prompt.high
            assert SPEC.output.low <= call.output_tokens <= SPEC.output.high
        alone = unloaded_duration_s(session.turns, SPEC.nominal_ttft_s, SPEC.nominal_tpot_s)
        lo, hi = SPEC.deadline_slack
        assert alone * lo - 0.01 <= session.deadline_s <= alone * hi + 0.01
    # Every tier and both client kinds appear, roughly in the configured mix.
    tiers = [s.tier for s in trace]
    for tier, share in SPEC.tier_mix.items():
        assert abs(tiers.count(tier) / len(trace) - share) < 0.1
    naive = sum(s.client is ClientKind.NAIVE for s in trace) / len(trace)
    assert abs(naive - SPEC.naive_share) < 0.1
    # Fan-out bursts happen: some turns run several calls in parallel.
    assert max(s.max_parallel for s in trace) == SPEC.fanout[1]


def test_a_higher_rate_packs_the_same_sessions_closer_together() -> None:
    slow = generate(SPEC, rate=1.0, duration_s=60, seed=9)
    fast = generate(SPEC, rate=4.0, duration_s=60, seed=9)
    assert len(fast) > 2 * len(slow)
    shared = min(len(slow), len(fast))
    assert [s.turns for s in slow[:shared]] == [s.turns for s in fast[:shared]]
    assert [s.tier for s in slow[:shared]] == [s.tier for s in fast[:shared]]


def test_lengths_are_clipped_to_their_range() -> None:
    import random

    dist = LengthDist(median=100, sigma=3.0, low=10, high=200)
    rng = random.Random(0)
    values = [dist.sample(rng) for _ in range(2000)]
    assert min(values) == 10 and max(values) == 200


def test_only_every_tier_in_the_vocabulary() -> None:
    trace = generate(SPEC, rate=3.0, duration_s=30, seed=1)
    assert {s.tier for s in trace} <= set(Tier)


@pytest.mark.parametrize(("rate", "duration"), [(0, 10), (1, 0), (-1, 5)])
def test_a_non_positive_rate_or_duration_is_refused(rate: float, duration: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        generate(SPEC, rate=rate, duration_s=duration, seed=1)
