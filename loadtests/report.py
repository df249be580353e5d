"""A sweep's report: the results table, the plots (PNG) and ``report.md`` with every statement
the results need to be read honestly (load against measured capacity, objectives against
unloaded latency, signals that moved, repeats, parameter sources, the full configuration)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests import stats

if TYPE_CHECKING:
    from loadtests.sweep import PointResult

MODES = ("direct", "kvgate-call", "kvgate-session")
TIERS = ("guaranteed", "standard", "besteffort")


def _fmt(value: float | None, digits: int = 2, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if pct else f"{value:.{digits}f}"


def _cell(spread: dict[str, Any], digits: int = 2, pct: bool = False) -> str:
    """median (min-max) over repeats."""
    if not spread or spread.get("median") is None:
        return "-"
    median = _fmt(spread["median"], digits, pct)
    if spread.get("n", 0) < 2:
        return median
    return f"{median} ({_fmt(spread['min'], digits, pct)}-{_fmt(spread['max'], digits, pct)})"


def table(summary: dict[str, Any]) -> str:
    """Markdown: one row per mode and load, medians over repeats with (min-max)."""
    capacity = summary["capacity_sessions_per_s"]
    lines = [
        "| mode | load (x capacity) | sessions/s offered (nominal) | session goodput /s "
        "| good sessions "
        "| admitted sessions that finished good | call goodput | wasted tokens | refused "
        "| guaranteed TTFT met | output tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, by_load in summary["modes"].items():
        for load, agg in by_load.items():
            guaranteed = agg.get("ttft_met_share_by_tier", {}).get("guaranteed", {})
            offered = agg.get("offered_per_s")
            lines.append(
                f"| {mode} | {load} | {_cell(offered)} ({float(load) * capacity:.2f}) "
                f"| {_cell(agg['session_goodput_per_s'])} "
                f"| {_cell(agg['session_goodput_fraction'], pct=True)} "
                f"| {_cell(agg.get('admitted_good_fraction'), pct=True)} "
                f"| {_cell(agg['call_goodput'], pct=True)} "
                f"| {_cell(agg['wasted_token_share'], pct=True)} "
                f"| {_cell(agg['refusal_rate'], pct=True)} "
                f"| {_cell(guaranteed, pct=True)} "
                f"| {_cell(agg['output_tokens_per_s'], 0)} |"
            )
    return "\n".join(lines)


def write(
    run: Path, summary: dict[str, Any], manifest: dict[str, Any], points: Sequence[PointResult]
) -> None:
    plots = _plots(run, summary, points)
    (run / "report.md").write_text(_markdown(summary, manifest, points, plots))


def _markdown(
    summary: dict[str, Any],
    manifest: dict[str, Any],
    points: Sequence[PointResult],
    plots: list[str],
) -> str:
    capacity = summary["capacity_sessions_per_s"]
    obj = summary["objectives"]
    unloaded = summary["unloaded"].get("direct") or {}
    moved = _signals_moved(points)
    probes = summary.get("capacity_probes") or []
    out = [
        "# Agent-session sweep",
        "",
        f"Command: `{manifest['command']}`  ",
        f"Created: {manifest['created']}; elapsed {summary['elapsed_s']:.0f} s.  ",
        f"Engine: {manifest['engine']['max_num_seqs']} sequences, "
        f"{manifest['engine']['kv_tokens']} KV tokens, vLLM {manifest['versions']['vllm']} "
        f"({manifest['versions']['vllm_distribution']}); hardware: "
        f"{manifest['hardware']['cores']} cores, {manifest['hardware']['cpu']}.",
        "",
        "## How to read it",
        "",
        f"- **Load** is relative to the capacity measured in this run: {capacity:.3f} sessions/s, "
        f"{manifest['capacity_rule']}."
        + (
            " Probes: "
            + ", ".join(f"{p['rate']:.3f}/s → {_probe_shares(p)} good" for p in probes)
            + "."
            if probes
            else " (capacity given, not searched)."
        ),
        (
            f"- **Objectives** are relative to the unloaded latency measured in this run on direct "
            f"vLLM (median of {unloaded.get('calls', '?')} sequential calls of "
            f"{unloaded.get('prompt_tokens', '?')} prompt / {unloaded.get('output_tokens', '?')} "
            "output tokens)"
            if not (given := manifest["objective_rule"].get("unloaded_given_ms"))
            else "- **Objectives** and deadlines are relative to an unloaded direct latency given "
            f"on the command line (`--unloaded`: TTFT {given[0]:g} ms, TPOT {given[1]:g} ms), "
            "not this run's probe"
        )
        + f": TTFT {manifest['objective_rule']['ttft']}, TPOT "
        f"{manifest['objective_rule']['tpot']}; "
        + ", ".join(
            f"{tier} {o['ttft_s'] * 1000:.1f} ms / {o['tpot_s'] * 1000:.2f} ms"
            for tier, o in obj.items()
        )
        + ". kvgate is configured with the same objectives (the run's `tenants.toml`, which "
        "its admission aims at), and every mode is judged by them.",
        "- **Rates** are over the arrival window: the offered rate counts the sessions that "
        "arrived in it (the nominal rate in brackets), so goodput per second cannot exceed it.",
        "- **Refused work counts**: a session refused by admission, or given up at its deadline, "
        "is offered and not good; its calls, sent or not, are in the call-goodput denominator.",
        f"- **Repeats**: {manifest['repeats']} per point (seeds {manifest['seeds']['sweep']}, the "
        "same traces in every mode); cells show the median and (min-max).",
        "- **Wasted tokens**: output tokens the engine generated for sessions that were not good, "
        "over all it generated (its own counter, cut-short calls included).",
        "",
        "## Results",
        "",
        table(summary),
        "",
        f"Overhead at low load (unloaded sequential calls, kvgate per-call minus direct): TTFT "
        f"p50 {_fmt(summary['overhead']['ttft_p50_ms'])} ms, "
        f"p99 {_fmt(summary['overhead']['ttft_p99_ms'])} ms.",
        "",
        "### Targets",
        "",
        "| target | wanted | measured | met |",
        "| --- | --- | --- | --- |",
    ]
    for name, t in summary["targets"].items():
        met = {True: "yes", False: "no", None: "-"}[t["met"]]
        out.append(f"| {name} | {t['target']} | {_fmt(t['measured'], 3)} | {met} |")
    out += [
        "",
        "### Did the signals move?",
        "",
        "Range over every point of each mode (a signal that never moved cannot have driven a "
        "decision). kvgate: the worker's heartbeat (KV usage, running, waiting incl. staged, "
        "committed tokens) and JetStream pending; direct: vLLM's `/metrics`.",
        "",
        "| mode | signal | min | max | moved |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, signals in moved.items():
        for name, s in signals.items():
            if s["min"] is None:
                continue
            out.append(
                f"| {mode} | {name} | {_fmt(s['min'])} | {_fmt(s['max'])} "
                f"| {'yes' if s['moved'] else 'no'} |"
            )
    out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    out += [
        "",
        "## Configuration",
        "",
        "Every parameter and where its value came from (`manifest.json` has the same):",
        "",
        "```json",
        json.dumps(manifest["parameters"], indent=1),
        "```",
        "",
        "Everything else (versions, hardware, model, engine, workload, kvgate settings, clients):"
        " `manifest.json`.",
        "",
    ]
    return "\n".join(out)


def _signals_moved(points: Sequence[PointResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for point in points:
        mode = out.setdefault(point.mode.value, {})
        for name, s in point.summary["signals_moved"].items():
            agg = mode.setdefault(name, {"min": None, "max": None, "moved": False})
            if s["min"] is not None:
                agg["min"] = s["min"] if agg["min"] is None else min(agg["min"], s["min"])
                agg["max"] = s["max"] if agg["max"] is None else max(agg["max"], s["max"])
            agg["moved"] = agg["moved"] or bool(s["moved"])
    return out


# -- plots -----------------------------------------------------------------------------------


def _plots(run: Path, summary: dict[str, Any], points: Sequence[PointResult]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    loads = sorted({float(load) for by in summary["modes"].values() for load in by})

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "session_goodput_per_s", "session goodput (good sessions / s)"),
        (axes[1], "call_goodput", "call goodput (met / offered)"),
    ):
        for mode, by_load in summary["modes"].items():
            xs, ys, lo, hi = [], [], [], []
            for load in loads:
                s = by_load.get(f"{load:g}", {}).get(key, {})
                if s.get("median") is None:
                    continue
                xs.append(load)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}x" for x in loads])
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Goodput against load (median, min-max over repeats)")
    fig.tight_layout()
    fig.savefig(run / "goodput.png", dpi=110)
    plt.close(fig)
    made.append("goodput.png")

    modes = list(summary["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.8), sharey=True)
    axes = axes if len(modes) > 1 else [axes]
    objective = min(o["ttft_s"] for o in summary["objectives"].values())
    for ax, mode in zip(axes, modes, strict=True):
        for tier in TIERS:
            for q, style in (("p50", "--"), ("p99", "-")):
                xs, ys = [], []
                for load in loads:
                    values = [
                        p.summary["by_tier"].get(tier, {}).get("ttft_s", {}).get(q)
                        for p in points
                        if p.mode.value == mode and p.load == load
                    ]
                    median = stats.percentile((v for v in values if v is not None), 50)
                    if median is not None:
                        xs.append(load)
                        ys.append(median)
                if xs:
                    ax.plot(xs, ys, style, marker=".", label=f"{tier} {q}")
        ax.axhline(objective, color="grey", lw=1, ls=":", label="TTFT objective (tightest)")
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}x" for x in loads])
        ax.set_title(mode)
        ax.set_xlabel("load (x capacity)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TTFT (s), completed calls")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run / "ttft_by_tier.png", dpi=110)
    plt.close(fig)
    made.append("ttft_by_tier.png")

    show = 2.0 if 2.0 in loads else loads[-1]
    chosen = [p for p in points if p.load == show and p.repeat == 0]
    if chosen:
        fig, axes = plt.subplots(len(chosen), 1, figsize=(9, 2.6 * len(chosen)), sharex=True)
        axes = axes if len(chosen) > 1 else [axes]
        for ax, point in zip(axes, chosen, strict=True):
            t = [s.t_s for s in point.samples]
            ax.plot(t, [s.kv_usage or 0 for s in point.samples], color="C0", label="KV usage")
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("KV usage")
            twin = ax.twinx()
            twin.plot(t, [s.waiting or 0 for s in point.samples], color="C1", label="waiting")
            if any(s.pending is not None for s in point.samples):
                pending = [s.pending or 0 for s in point.samples]
                twin.plot(t, pending, color="C2", label="JetStream pending")
            twin.set_ylabel("calls")
            ax.set_title(f"{point.mode.value}, {show:g}x, repeat 1")
            lines = ax.get_lines() + twin.get_lines()
            ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="upper right")
        axes[-1].set_xlabel("seconds from the point's start")
        fig.tight_layout()
        fig.savefig(run / "kv_and_queue.png", dpi=110)
        plt.close(fig)
        made.append("kv_and_queue.png")
    return made


def _probe_shares(probe: dict[str, Any]) -> str:
    """A capacity probe's good share, one per trace it ran (before the search ran several
    traces a rate, the one share)."""
    shares = probe.get("shares") or [probe["good_share"]]
    return " / ".join(f"{share:.0%}" for share in shares)
