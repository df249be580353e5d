"""Percentiles of a benchmark's samples: the one definition every benchmark in kvgate reports.

Definition. Sort the n samples, x[0] <= ... <= x[n-1]. The q-th percentile (q a whole
number from 0 to 100) sits at position h = (n - 1) * q / 100 and is interpolated linearly
between the two closest ranks:

    x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])

So p0 is the smallest sample, p100 the largest, p50 the median; one sample is every
percentile of itself; no samples have no percentile (``None``). Example: [1, 2, 3, 4] has
p50 2.5 and p90 3.7.

This is the standard library's ``statistics.quantiles(values, n=100, method="inclusive")``,
which computes it here, and numpy's default ``numpy.percentile(values, q)`` (method
"linear"; R's default, type 7, is the same). Why this one: a reader can check any number
with a library they already have; it needs no new dependency; kvgate's admission pace
(``broker.admission.objectives``) already uses it at run time. Unlike nearest rank, it moves
smoothly as samples change instead of jumping from one sample to the next, but a tail
percentile of few samples still rests on the largest two of them: p99 of 40 samples is 0.61
of the way from the second largest to the largest.

Whole percents only: ``statistics.quantiles(n=100)`` gives the 99 cut points between them,
and no benchmark reports a finer one.

Results stored before this module were computed with other definitions: nearest rank
(``loadtests.metrics``: the sweep's summaries), the rounded index x[round(h)]
(``bench_admission``, ``bench_worker``, ``bench_batch``) and the floor index x[floor(n q /
100)] (``bench_tracing``); ``bench_ttft`` already used this one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

PERCENTS = (50, 95, 99)


def percentiles(values: Iterable[float], qs: Iterable[int]) -> dict[int, float | None]:
    """Each percentile ``q`` in ``qs`` (whole percents, 0 to 100) of ``values``, sorting once;
    each is ``None`` when there are no values."""
    data = list(values)
    wanted = tuple(qs)
    for q in wanted:
        if not isinstance(q, int) or not 0 <= q <= 100:
            raise ValueError(f"a percentile is a whole number from 0 to 100, not {q!r}")
    if not data:
        return dict.fromkeys(wanted)
    if len(data) == 1:
        # statistics.quantiles needs two points; interpolating within one gives that point.
        return dict.fromkeys(wanted, float(data[0]))
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    low, high = float(min(data)), float(max(data))
    # Interpolating between equal values can land a rounding error outside them (the median of
    # 0.23333334, 0.23333334 and 0.3 came out as 0.2333...3, below the minimum, and the report's
    # error bars refused the negative length): clamped to the values' range.
    return {
        q: low if q == 0 else high if q == 100 else min(max(cuts[q - 1], low), high) for q in wanted
    }


def percentile(values: Iterable[float], q: int) -> float | None:
    """The ``q``-th percentile of ``values`` by the module's definition; ``None`` for none."""
    return percentiles(values, (q,))[q]


def summary(
    values: Iterable[float], qs: Iterable[int] = PERCENTS, *, ndigits: int | None = None
) -> dict[str, float | int | None]:
    """``{"n": count, "p50": ..., ...}`` for ``qs``, each rounded to ``ndigits`` if given;
    the percentiles are ``None`` when there are no values."""
    data = list(values)
    out: dict[str, float | int | None] = {"n": len(data)}
    for q, value in percentiles(data, qs).items():
        out[f"p{q}"] = value if value is None or ndigits is None else round(value, ndigits)
    return out
