"""The runner's pure step: which lines of a session may start now, and at what cost."""

from __future__ import annotations

import itertools
import time

from api.batches.openlines import BatchLines
from api.batches.store import OPEN_LINES, LineState, LineStatus

QUADRATIC_BOUND_S = 1.0
"""Generous for a loaded machine: the one-pass rule decides the session below in
milliseconds; the rescan per pending line took 6.5 s on it (and several times that on a slow
host), so the bound tells the two apart without timing the fast one."""


def session(statuses: str, parallel: str = "") -> list[LineState]:
    """A session's lines: one status letter each (pending, running, completed, failed), and the
    parallel flag of each ('p'), defaulting to off."""
    names = {"p": LineStatus.PENDING, "r": LineStatus.RUNNING, "c": LineStatus.COMPLETED}
    names["f"] = LineStatus.FAILED
    flags = parallel.ljust(len(statuses), ".")
    return [
        LineState(i, i + 1, "s", flags[i] == "p", names[s].value, f"b-{i}")
        for i, s in enumerate(statuses)
    ]


def started(lines: list[LineState]) -> list[int]:
    sessions = BatchLines.build(lines).sessions
    return [line.id for line in sessions["s"].runnable()] if sessions else []


def reference(lines: list[LineState]) -> list[int]:
    """The rule as stated: a pending line waits for every line before its run of parallel lines
    (a run is a line and the parallel lines right after it)."""
    out = []
    for i, line in enumerate(lines):
        start = i
        while start > 0 and lines[start].parallel:
            start -= 1
        if line.status == LineStatus.PENDING.value and all(
            x.status not in OPEN_LINES for x in lines[:start]
        ):
            out.append(line.id)
    return out


def test_lines_start_in_order_and_parallel_runs_together() -> None:
    assert started(session("ppp")) == [0]
    assert started(session("cfpp")) == [2]
    assert started(session("crpp", "..p.")) == [2]
    assert started(session("cppp", ".pp.")) == [1, 2]
    assert started(session("rpp", ".pp")) == [1, 2]
    assert started(session("")) == []
    for statuses in itertools.product("prc", repeat=5):
        for flags in itertools.product(".p", repeat=5):
            lines = session("".join(statuses), "".join(flags))
            assert started(lines) == reference(lines), (statuses, flags)


def test_deciding_what_starts_takes_time_in_proportion_to_the_lines() -> None:
    # Half of a 20,000-line session done: each pending line used to rescan every line before it.
    lines = session("c" * 10_000 + "p" * 10_000)
    began = time.perf_counter()
    assert started(lines) == [10_000]
    assert time.perf_counter() - began < QUADRATIC_BOUND_S
