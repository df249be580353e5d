"""The rehearsal's report (``loadtests/rehearsal.py``): ``report.md``'s tables and, where
matplotlib is installed, the plots against the fleet size, all read from ``summary.json``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report_md(summary: dict[str, Any], manifest: dict[str, Any]) -> str:
    steps = summary["steps"]
    labels = list(summary["pure"])
    fit = summary["per_heartbeat_fit"]
    out = [f"# Rehearsal: {manifest['command']}", ""]
    out += [
        "Fleet: workers visible to every front door (s after their processes started), "
        "resident memory (MiB):",
        "",
        table(
            ["N", "visible after s", "worker processes MiB", "NATS MiB (each)", "doors MiB"],
            [
                [
                    s["workers"],
                    s["visible_s"],
                    s["rss_mib"]["workers"],
                    "/".join(str(m) for m in s["rss_mib"]["nats"]),
                    "/".join(str(m) for m in s["rss_mib"]["doors"].values()),
                ]
                for s in steps
            ],
        ),
        "",
        f"CPU per heartbeat, fitted over the quiet windows of N = {fit['steps']}: "
        + ", ".join(f"door {lb} {us} µs" for lb, us in fit["doors_us"].items())
        + f", NATS (3 servers) {fit['nats_us']} µs, worker processes {fit['workers_us']} µs "
        "(idle pull credit and every other per-worker cost included).",
        "",
    ]
    out += [
        "Heartbeat fan-in and idle pull credit (quiet window):",
        "",
        table(
            [
                "N",
                "heartbeats/s",
                *[f"door {lb} CPU µs/heartbeat" for lb in labels],
                "NATS CPU µs/heartbeat",
                "pull requests/s",
                "408/s",
                "409/s",
                "waiting (g/s/b)",
                "max_waiting",
                "worker CPU ms/s each",
            ],
            [
                [
                    s["workers"],
                    s["quiet"]["heartbeats_per_s"],
                    *[s["quiet"]["doors"][lb]["cpu_us_per_heartbeat"] for lb in labels],
                    s["quiet"]["nats_cpu_us_per_heartbeat"],
                    s["quiet"]["pull_requests_per_s"],
                    s["quiet"]["pull_answers_per_s"]["408"],
                    s["quiet"]["pull_answers_per_s"]["409"],
                    "/".join(str(c["num_waiting"]) for c in s["quiet"]["consumers"].values()),
                    s["quiet"]["consumers"]["standard"]["max_waiting"],
                    s["quiet"]["worker_cpu_ms_per_s"],
                ]
                for s in steps
            ],
        ),
        "",
        "Admission (open loop; client latency, the ledger's decision time, Redis and CPU per "
        "decision):",
        "",
        table(
            [
                "N",
                "door",
                "sessions",
                "client p50/p99 ms",
                "decision p50/p99 µs",
                "Redis cmds/admission",
                "door CPU ms/admission",
            ],
            [
                [
                    s["workers"],
                    lb,
                    a["decisions"],
                    f"{a['client_p50_ms']}/{a['client_p99_ms']}",
                    f"{a['server_p50_us']}/{a['server_p99_us']}",
                    a["redis_calls_per_admission"],
                    a["door_cpu_ms_per_admission"],
                ]
                for s in steps
                for lb, a in s["admission"].items()
            ],
        ),
        "",
        "Calls (closed loop; the rate this machine sustains, CPU per call by component):",
        "",
        table(
            [
                "N",
                "door",
                "calls/s",
                "p50/p99 ms",
                "decision p50 µs",
                "door ms/call",
                "NATS ms/call",
                "workers ms/call",
                "Redis cmds/call",
                "pulls/call",
                "waiting mid-run (g/s/b)",
                "busy",
            ],
            [
                [
                    s["workers"],
                    lb,
                    c["calls_per_s"],
                    f"{c['p50_ms']}/{c['p99_ms']}",
                    c["decision_p50_us"],
                    c["cpu_ms_per_call"]["door"],
                    c["cpu_ms_per_call"]["nats"],
                    c["cpu_ms_per_call"]["workers"],
                    c["redis_calls_per_call"],
                    c["pull_requests_per_call"],
                    "/".join(str(t["num_waiting"]) for t in c["consumers_midway"].values()),
                    c["machine_busy_share"],
                ]
                for s in steps
                for lb, c in s["calls"].items()
            ],
        ),
        "",
        "Per-message costs, in-process (µs; loadtests/fleetcosts.py; decisions 2 ms apart):",
        "",
        table(
            [
                "N",
                "tree",
                "heartbeat applied",
                "readings: mean",
                "readings: slowest",
                "decide",
                "models check",
            ],
            [
                [
                    n,
                    lb,
                    p["heartbeat_update_us"],
                    p["snapshot_mean_us"],
                    p["snapshot_max_us"],
                    p["decide_us"],
                    p["models_us"],
                ]
                for lb, pure in summary["pure"].items()
                for n, p in pure.items()
            ],
        ),
        "",
    ]
    return "\n".join(out)


def plots(out: Path, summary: dict[str, Any]) -> list[str]:
    """The PNGs, where matplotlib is installed; the names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    steps = summary["steps"]
    labels = list(summary["pure"])
    ns = [s["workers"] for s in steps]
    written = []

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(ns, [s["quiet"]["heartbeats_per_s"] for s in steps], "o-")
    left.set(xlabel="workers", ylabel="heartbeats/s into KVGATE_WORKERS", title="fan-in")
    for lb in labels:
        right.plot(
            ns,
            [s["quiet"]["doors"][lb]["cpu_us_per_heartbeat"] for s in steps],
            "o-",
            label=f"front door ({lb})",
        )
    right.plot(ns, [s["quiet"]["nats_cpu_us_per_heartbeat"] for s in steps], "s--", label="NATS x3")
    right.set(xlabel="workers", ylabel="CPU µs per heartbeat", title="cost of one heartbeat")
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "fanin.png", dpi=110)
    written.append("fanin.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for lb in labels:
        left.plot(ns, [s["admission"][lb]["server_p50_us"] for s in steps], "o-", label=f"{lb} p50")
        left.plot(ns, [s["admission"][lb]["server_p99_us"] for s in steps], "o:", label=f"{lb} p99")
        pure = summary["pure"][lb]
        sizes = [int(n) for n in pure]
        right.plot(
            sizes,
            [pure[str(n)]["snapshot_mean_us"] + pure[str(n)]["decide_us"] for n in sizes],
            "o-",
            label=f"snapshot + decide ({lb})",
        )
    left.set(xlabel="workers", ylabel="decision time, µs (ledger)", title="admission, end to end")
    left.set_yscale("log")
    left.legend()
    right.set(xlabel="workers", ylabel="µs per decision", title="pure cost, in-process")
    right.set_xscale("log")
    right.set_yscale("log")
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "admission.png", dpi=110)
    written.append("admission.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for tier in ("guaranteed", "standard", "besteffort"):
        left.plot(
            ns,
            [s["quiet"]["consumers"][tier]["num_waiting"] for s in steps],
            "o-",
            label=f"{tier}, quiet",
        )
        first = labels[0]
        left.plot(
            ns,
            [s["calls"][first]["consumers_midway"][tier]["num_waiting"] for s in steps],
            "x:",
            label=f"{tier}, under calls",
        )
    left.axhline(
        steps[0]["quiet"]["consumers"]["standard"]["max_waiting"] or 512,
        color="red",
        label="max_waiting",
    )
    left.set(xlabel="workers", ylabel="pull requests waiting", title="tier consumers")
    left.legend(fontsize=7)
    right.plot(ns, [s["quiet"]["pull_requests_per_s"] for s in steps], "o-")
    right.set(xlabel="workers", ylabel="pull requests/s (quiet)", title="idle pull credit renewal")
    right.set_yscale("symlog", linthresh=10)
    fig.tight_layout()
    fig.savefig(out / "consumers.png", dpi=110)
    written.append("consumers.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for lb in labels:
        left.plot(ns, [s["calls"][lb]["calls_per_s"] for s in steps], "o-", label=lb)
    left.set(xlabel="workers", ylabel="calls/s", title="end-to-end call rate (this machine)")
    left.set_ylim(bottom=0)
    left.legend()
    # Per-call costs are counted above the quiet window's background: where that background
    # already filled the machine, they mean nothing, and are left out.
    calm = [s for s in steps if s["quiet"]["machine_busy_share"] < 0.5]
    calm_ns = [s["workers"] for s in calm]
    for lb in labels:
        right.plot(
            calm_ns,
            [s["calls"][lb]["cpu_ms_per_call"]["door"] for s in calm],
            "o-",
            label=f"front door ({lb})",
        )
    for part in ("nats", "workers"):
        right.plot(
            calm_ns,
            [
                statistics.fmean(s["calls"][lb]["cpu_ms_per_call"][part] for lb in labels)
                for s in calm
            ],
            "s--",
            label=part,
        )
    right.set(xlabel="workers", ylabel="CPU ms per call", title="cost of one call (calm steps)")
    right.set_ylim(bottom=0)
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "calls.png", dpi=110)
    written.append("calls.png")
    plt.close("all")
    return written


def write(out: Path, summary: dict[str, Any], manifest: dict[str, Any]) -> None:
    """``report.md`` and the plots in the run folder ``out``."""
    written = plots(out, summary)
    (out / "report.md").write_text(
        report_md(summary, manifest) + "".join(f"\n![{n}]({n})\n" for n in written)
    )


def main() -> None:
    """``python -m loadtests.rehearsal_report RUN_FOLDER``: the report again, from the run's
    ``summary.json`` and ``manifest.json``."""
    out = Path(sys.argv[1])
    summary = json.loads((out / "summary.json").read_text())
    write(out, summary, json.loads((out / "manifest.json").read_text()))


if __name__ == "__main__":
    main()
