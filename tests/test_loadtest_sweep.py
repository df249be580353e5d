"""A tiny sweep, end to end against real processes (vLLM's own OpenAI server, then NATS, a kvgate
worker and the front door): every mode runs and the run folder is complete and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from broker.admission.tenants import Tenancy
from loadtests.sweep import Sweep, build_parser, profile_from
from loadtests.workload import load_jsonl
from schemas.vocab import Tier

MODES = {"direct", "kvgate-call", "kvgate-session"}


def test_a_tiny_sweep_writes_a_complete_run_folder(tmp_path: Path, dev_model: Path) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "loadtests.sweep", "--profile", "tiny"]
    done = subprocess.run(
        [*command, "--model", str(dev_model), "--out", str(run)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| kvgate-session | 1 |" in done.stdout  # the results table

    manifest = json.loads((run / "manifest.json").read_text())
    for key in ("versions", "hardware", "model", "engine", "workload", "objectives", "seeds"):
        assert manifest[key], key
    assert manifest["versions"]["vllm"]
    assert manifest["parameters"]["capacity"]["source"] == "profile tiny"
    assert manifest["parameters"]["loads"]["value"] == [1.0]

    summary = json.loads((run / "summary.json").read_text())
    points = summary["points"]
    assert {p["mode"] for p in points} == MODES
    # Objectives come from the unloaded latency measured in the same run, and are what kvgate
    # ran with: the run's tenants file holds them for every tier.
    unloaded = summary["unloaded"]["direct"]
    tenancy = Tenancy.from_file(run / "tenants.toml")
    for tier in Tier:
        ttft_ms = round(unloaded["ttft_s"]["p50"] * 30 * 1000, 1)
        assert tenancy.tiers[tier].ttft_ms == ttft_ms
        assert summary["objectives"][tier.value]["ttft_s"] == ttft_ms / 1000
    # Rates are over the arrival window: goodput per second never exceeds the offered rate.
    for p in points:
        assert p["session_goodput_per_s"] <= p["offered_per_s"]
    assert summary["overhead"]["ttft_p50_ms"] is not None

    # Every mode replayed the same trace, and every session and call of it is accounted for.
    (trace_file,) = (run / "traces").glob("trace-seed7-*.jsonl")
    trace = load_jsonl(trace_file)
    assert trace
    calls = [json.loads(line) for line in (run / "calls.jsonl").read_text().splitlines()]
    sessions = [json.loads(line) for line in (run / "sessions.jsonl").read_text().splitlines()]
    for mode in MODES:
        assert sorted(s["session_id"] for s in sessions if s["mode"] == mode) == sorted(
            s.session_id for s in trace
        )
        mode_calls = [c for c in calls if c["mode"] == mode]
        assert len(mode_calls) == sum(len(s.calls) for s in trace)
        point = next(p for p in points if p["mode"] == mode)
        assert point["sessions_offered"] == len(trace)
        assert point["calls_offered"] == len(mode_calls)
        # At this load every call is served, and the engine's counter saw the tokens.
        assert point["calls_by_status"] == {"ok": len(mode_calls)}
        assert point["tokens_generated_source"] == "engine"
        assert point["tokens_generated"] >= point["tokens_received"] > 0
        # A heartbeat may catch a short call before the engine's first step for it (held,
        # committed, no KV yet): for kvgate, either of the worker's two readings counts.
        moved = point["signals_moved"]
        assert moved["kv_usage"]["moved"] or (
            mode != "direct" and moved["committed_tokens"]["moved"]
        ), moved

    # The front door recorded an admission decision for every session it was asked about.
    decisions = [json.loads(line) for line in (run / "decisions.jsonl").read_text().splitlines()]
    session_scoped = [d for d in decisions if d["scope"] == "session"]
    assert len(session_scoped) >= len(trace)
    assert all(d["decision"] in {"admit", "defer", "reject"} for d in decisions)
    assert all("capacity_tokens" in d["signals"] for d in decisions)

    for plot in ("goodput.png", "ttft_by_tier.png", "kv_and_queue.png"):
        assert (run / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    report = (run / "report.md").read_text()
    assert "relative to the capacity measured" in report
    assert "Refused work counts" in report
    assert "![goodput.png](goodput.png)" in report


def test_given_unloaded_latency_sets_the_objectives_and_deadlines(tmp_path: Path) -> None:
    # Side-by-side runs share their objectives and deadlines instead of each taking its own
    # from a probe that moves with the machine.
    args = build_parser().parse_args(
        ["--profile", "tiny", "--unloaded", "12.5,2", "--capacity", "3"]
    )
    profile = profile_from(args)
    assert profile.unloaded_ms == (12.5, 2.0)
    assert profile.sources["unloaded_ms"] == "command line"
    sweep = Sweep(profile, tmp_path / "model", tmp_path)
    sweep._set_objectives()
    tenancy = Tenancy.from_file(tmp_path / "tenants.toml")
    for tier in Tier:
        assert tenancy.tiers[tier].ttft_ms == 12.5 * profile.ttft_factor
        assert tenancy.tiers[tier].tpot_ms == 2.0 * profile.tpot_factor
    workload = sweep._nominal_workload()
    assert (workload.nominal_ttft_s, workload.nominal_tpot_s) == (0.0125, 0.002)
