"""The benchmarks' one percentile definition (``loadtests.stats``), pinned by values computed
by hand: linear interpolation between closest ranks, numpy's default."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtests.stats import percentile, percentiles, summary


def test_percentiles_interpolate_between_the_closest_ranks() -> None:
    # Position (n - 1) * q / 100: 1.5 for p50, 2.7 for p90, 0.75 for p25.
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([4.0, 1.0, 3.0, 2.0], 25) == 1.75  # order of the input does not matter
    # 1..100: nearest rank would give 50 and 99 here.
    hundred = [float(v) for v in range(1, 101)]
    assert percentiles(hundred, (50, 99)) == {50: 50.5, 99: pytest.approx(99.01)}


def test_p0_and_p100_are_the_extremes_and_p50_the_median() -> None:
    values = [7.0, 3.0, 9.0, 1.0, 5.0]
    assert percentiles(values, (0, 50, 100)) == {0: 1.0, 50: 5.0, 100: 9.0}


def test_a_percentile_never_falls_outside_the_values_by_a_rounding_error() -> None:
    # statistics.quantiles gives 0.2333...3 here, below the minimum: a median of three rates
    # that the report's error bars then refused as a negative length.
    rates = [7 / 30, 7 / 30, 0.3]
    assert percentile(rates, 50) == 7 / 30
    for q in range(101):
        value = percentile(rates, q)
        assert value is not None and min(rates) <= value <= max(rates)


def test_one_value_is_every_percentile_of_itself_and_no_values_have_none() -> None:
    assert percentiles([3.0], (0, 50, 99, 100)) == {0: 3.0, 50: 3.0, 99: 3.0, 100: 3.0}
    assert percentile([], 50) is None
    assert summary([]) == {"n": 0, "p50": None, "p95": None, "p99": None}


def test_summary_counts_and_rounds() -> None:
    values = [0.001, 0.002, 0.003, 0.004]
    assert summary(values, (50, 90), ndigits=4) == {"n": 4, "p50": 0.0025, "p90": 0.0037}
    assert summary(iter(values), (50,)) == {"n": 4, "p50": pytest.approx(0.0025)}


@pytest.mark.parametrize("q", [-1, 101, 99.5])
def test_a_percentile_is_a_whole_number_from_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match="whole number"):
        percentile([1.0, 2.0], q)  # type: ignore[arg-type]


def test_the_definition_is_numpys_default() -> None:
    rng = random.Random(7)
    for n in (2, 3, 10, 41, 1000):
        values = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
        qs = (0, 1, 25, 50, 90, 95, 99, 100)
        expected = {q: float(np.percentile(values, q)) for q in qs}
        assert percentiles(values, qs) == pytest.approx(expected, rel=1e-12)
