"""How well check 4's prediction held for the sessions a sweep admitted: each admitted session's
time from its admission to its end over the ``fastest_finish_s`` its admission predicted, by
how busy the front door read the fleet (``fleet_busy``) when it admitted it.

Check 4 (``broker.admission.policy``) rejects a session whose deadline is shorter than that
prediction, so a ratio well under 1 is a session the pace judged slower than it ran (where
sessions are turned away that would have finished), and one over 1 a session that ran slower
than judged (where admitted sessions miss their deadlines).

    python -m loadtests.pace_calibration RUN_FOLDER [RUN_FOLDER ...] [--split 0.7] [--load N]

Each folder is one ``loadtests.sweep`` run of one repeat with ``decisions.jsonl`` (the ledger's
rows, gzipped or not) and ``sessions.jsonl``. One load of the run is read (``--load``: its
place in the run, 0 the first, -1 the last, the default): the sweep drains between loads, so
its session decisions are those between two pauses of over ``PHASE_GAP_S``, and its admitted
sessions pair with its admit decisions in order of admission. A run where the two counts
differ is reported and skipped, never paired wrongly.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtests.stats import percentiles

PHASE_GAP_S = 8.0
"""Longer than any pause between two session decisions within a load of the CPU sweep, shorter
than the drain between loads."""


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        path = path.with_name(path.name + ".gz")
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as lines:
        for line in lines:
            yield json.loads(line)


def load_ratios(run: Path, place: int = -1) -> list[tuple[float, float]] | None:
    """(how busy the fleet read at admission, took over predicted) for each session admitted at
    the run's load in ``place``, by how busy; ``None`` where admissions and sessions do not
    pair."""
    decisions = [d for d in _rows(run / "decisions.jsonl") if d["scope"] == "session"]
    at = [datetime.datetime.fromisoformat(d["decided_at"]) for d in decisions]
    pauses = [i for i in range(1, len(at)) if (at[i] - at[i - 1]).total_seconds() > PHASE_GAP_S]
    bounds = list(zip([0, *pauses], [*pauses, len(decisions)], strict=True))
    offered = list(_rows(run / "sessions.jsonl"))
    loads = list(dict.fromkeys(s["load"] for s in offered))
    if len(bounds) != len(loads):
        return None
    start, end = bounds[place]
    admits = [d for d in decisions[start:end] if d["decision"] == "admit"]
    load = loads[place]
    admitted = sorted(
        (s for s in offered if s["load"] == load and s["admitted"]),
        key=lambda s: s["arrival_s"] + s["admission_wait_s"],
    )
    if len(admits) != len(admitted):
        return None
    ratios = []
    for decision, session in zip(admits, admitted, strict=True):
        predicted = decision["signals"].get("fastest_finish_s")
        busy = decision["signals"].get("fleet_busy")
        if not predicted or busy is None or session["ended_s"] is None:
            continue
        took = session["ended_s"] - session["arrival_s"] - session["admission_wait_s"]
        ratios.append((busy, took / predicted))
    return sorted(ratios)


def band_summary(ratios: list[float]) -> str:
    cuts = percentiles(ratios, (10, 50, 90))
    return (
        f"{len(ratios)} sessions, took/predicted median {cuts[50]:.2f}, "
        f"10th-90th percentile {cuts[10]:.2f}-{cuts[90]:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument(
        "--split", type=float, default=0.7, help="report sessions below and above this busy"
    )
    parser.add_argument(
        "--load", type=int, default=-1, help="the load's place in the run (0 the first)"
    )
    args = parser.parse_args(argv)
    quiet: list[float] = []
    busy: list[float] = []
    for run in args.runs:
        ratios = load_ratios(run, args.load)
        if ratios is None:
            print(f"{run}: admissions and admitted sessions do not pair; skipped")
            continue
        print(f"{run.name}: " + " ".join(f"{b:.2f}:{r:.2f}" for b, r in ratios))
        for b, r in ratios:
            (quiet if b < args.split else busy).append(r)
    for label, band in ((f"busy < {args.split}", quiet), (f"busy >= {args.split}", busy)):
        if band:
            print(f"{label}: {band_summary(band)}")


if __name__ == "__main__":
    main()
