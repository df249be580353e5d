"""The pace calibration report: which sessions it pairs with which admissions, and what it
refuses to pair."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.pace_calibration import load_ratios, main


def decision(
    at: str, kind: str, busy: float | None = None, predicted: float | None = None
) -> dict[str, Any]:
    signals = {} if busy is None else {"fleet_busy": busy, "fastest_finish_s": predicted}
    return {"decided_at": at, "scope": "session", "decision": kind, "signals": signals}


def session(
    load: float, arrival: float, wait: float, ended: float | None, admitted: bool = True
) -> dict[str, Any]:
    return {
        "load": load,
        "arrival_s": arrival,
        "admission_wait_s": wait,
        "ended_s": ended,
        "admitted": admitted,
    }


def write_run(run: Path, decisions: list[dict[str, Any]], sessions: list[dict[str, Any]]) -> Path:
    run.mkdir()
    with gzip.open(run / "decisions.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(d) + "\n" for d in decisions)
    (run / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sessions))
    return run


def test_the_last_loads_admissions_pair_with_its_admitted_sessions_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(
        tmp_path / "run",
        [
            # The first load: more than 8 s before the last load's first decision.
            decision("2026-12-07 06:00:00", "admit", 0.9, 10.0),
            decision("2026-12-07 06:00:20", "admit", 0.2, 10.0),
            decision("2026-12-07 06:00:21", "defer"),
            decision("2026-12-07 06:00:25", "admit", 0.9, 20.0),
            decision("2026-12-07 06:00:26", "reject"),
        ],
        [
            session(4.0, 0.0, 0.0, 5.0),
            # Admitted second, though it arrived first: it waited 4 s.
            session(1.0, 0.5, 4.0, 14.5),
            session(1.0, 1.0, 0.0, 16.0),
            session(1.0, 2.0, 0.0, None, admitted=False),
        ],
    )
    assert load_ratios(run) == [(0.2, 1.5), (0.9, 0.5)]
    assert load_ratios(run, 0) == [(0.9, 0.5)]  # the first load: 5 s against 10 predicted
    main([str(run), "--split", "0.5"])
    out = capsys.readouterr().out
    assert "run: 0.20:1.50 0.90:0.50" in out
    assert "busy < 0.5: 1 sessions, took/predicted median 1.50" in out
    assert "busy >= 0.5: 1 sessions, took/predicted median 0.50" in out


def test_a_run_whose_admissions_do_not_pair_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(
        tmp_path / "run",
        [decision("2026-12-07 06:00:00", "admit", 0.5, 10.0)],
        [session(1.0, 0.0, 0.0, 5.0), session(1.0, 1.0, 0.0, 6.0)],
    )
    assert load_ratios(run) is None
    main([str(run)])
    assert "do not pair; skipped" in capsys.readouterr().out
