"""Issue 15's "1,000-GPU rehearsal": hundreds of simulated workers against a real three-server
NATS JetStream cluster (streams and the workers bucket at three replicas), one or two real front
doors and a Redis of the run's own, to measure how kvgate's own control traffic grows with the
number of workers N.

The fleet grows in steps (``--sizes``). Workers run as ``Worker`` objects on simulated engines,
many to a process (``--host-size``, ``loadtests/fleethost.py``); each step adds processes until
N workers are live in every front door's fleet view (``loadtests/rehearsal_stack.py`` starts
and meters the system). At each step:

1. **quiet** (``--quiet-s``): nothing but heartbeats and idle pull credit. Heartbeats into the
   workers bucket are counted by a plain subscription on ``$KV.KVGATE_WORKERS.>``; every
   process's CPU is read from ``/proc/<pid>/stat``; a front door's CPU per heartbeat is its CPU
   rate above its rate with no worker at all, over the heartbeats it received. The tier
   consumers' state (``consumer_info``: waiting pull requests, acks pending) is read, and the
   worker processes count the pull requests they send and the status answers they get.
2. **admission** (``--admit-rate`` sessions/s for ``--admit-s``, open loop, one front door at a
   time): ``POST /v1/sessions`` latency at the client, the decision time each ledger row
   records, Redis commands per admission (``INFO commandstats`` before and after, less the
   quiet window's background rate), the front door's CPU per admission.
3. **calls** (``--call-clients`` clients for ``--call-s``, closed loop, one front door at a
   time): plain non-streamed chat calls of ``--call-tokens`` tokens on simulated engines with a
   tiny step cost, so the rate is the control plane's limit on this machine, not an engine's;
   each component's CPU per call (front door, NATS, workers, Redis).

Before anything starts, the per-message costs are timed in-process for fleets of
``--pure-sizes`` workers (``loadtests/fleetcosts.py``): these extrapolate; the totals measured
on this shared 2-core machine do not.

``--compare-tree DIR`` runs a second front door from another kvgate source tree (its packages
first on ``PYTHONPATH``) beside this tree's, on the same fleet, Redis and NATS, and measures
both in every step, taking turns at going first: before and after a change, side by side in
one run. The workers run this tree's code.

    flock /tmp/kvgate-bench.lock .venv/bin/python -m loadtests.rehearsal \\
        --out loadtests/results/rehearsal-<name>/

The run folder gets ``manifest.json`` (every parameter and where its value came from, versions,
machine), ``summary.json`` (every step), ``report.md`` (the tables) and, with matplotlib,
``fanin.png``, ``admission.png``, ``consumers.png`` and ``calls.png``
(``loadtests/rehearsal_report.py``). Logs stay in ``--work`` (a temporary folder unless given).
About 7 minutes with the default sizes and two front doors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.client import Client as NATS

from broker.natsserver import find_binary
from loadtests import rehearsal_report as report
from loadtests import stats
from loadtests.bench_admission import paced
from loadtests.rehearsal_stack import (
    ADMIN_TOKEN,
    MODEL,
    REPO,
    START_BOUND_S,
    Cluster,
    Door,
    Fleet,
    Meter,
    OwnRedis,
    Span,
    WorkerShape,
    consumers,
    count_heartbeats,
    live_workers,
    machine_busy,
    rss_mib,
    start_door,
    tree_path,
    which_tree,
)

SETTLE_S = 4.0
"""After a step's workers are all visible, before its quiet window: their start-up (stream
and consumer provisioning, first pull requests) is not counted as steady traffic."""
SWEEP_PAUSE_S = 2.5
"""After an admission window: its sessions idle out (2 s) and are swept, its ledger rows are
written; the Redis commands and CPU this takes count to the window."""


# -- load ----------------------------------------------------------------------------------------

SESSION = {
    "tier": "standard",
    "max_parallel": 1,
    "expected_calls": 1,
    "est_prompt_tokens": 16,
    "est_output_tokens": 8,
    "idle_timeout_s": 2,
    "max_wait_s": 0,
}
"""A small session, idling out after 2 s, answered at once: the state stays small, and a
deferral is answered, not held."""


async def open_loop(door: Door, rate: float, seconds: float) -> dict[str, Any]:
    """``POST /v1/sessions`` at ``rate`` a second, whatever the answers' latency."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(door.base, connector=connector) as client:

        async def one() -> None:
            started = time.perf_counter()
            async with client.post("/v1/sessions", json=SESSION) as resp:
                await resp.read()
            latencies.append((time.perf_counter() - started) * 1000)
            statuses[resp.status] += 1

        await paced(rate, int(rate * seconds), one)
    cuts = stats.summary(latencies, (50, 99), ndigits=2)
    return {
        "sessions": len(latencies),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "client_p50_ms": cuts["p50"],
        "client_p99_ms": cuts["p99"],
    }


async def closed_loop(
    door: Door, clients: int, seconds: float, tokens: int, nc: NATS
) -> dict[str, Any]:
    """``clients`` callers, each sending its next plain call when the last is answered; the
    tier consumers are read half-way."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "next step"}],
        "max_tokens": tokens,
    }
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(door.base, connector=connector, timeout=timeout) as client:
        stop_at = time.perf_counter() + seconds

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                async with client.post("/v1/chat/completions", json=body) as resp:
                    await resp.read()
                statuses[resp.status] += 1
                if resp.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    await asyncio.sleep(0.05)  # a refusal: do not spin on it

        async def midway() -> dict[str, dict[str, int | None]]:
            await asyncio.sleep(seconds / 2)
            return await consumers(nc)

        t0 = time.perf_counter()
        mid = asyncio.create_task(midway())
        await asyncio.gather(*(caller() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    cuts = stats.summary(latencies, (50, 99), ndigits=1)
    return {
        "calls": len(latencies),
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "p50_ms": cuts["p50"],
        "p99_ms": cuts["p99"],
        "consumers_midway": await mid,
    }


def ledger_rows(door: Door) -> list[tuple[int, str, int]]:
    """Decisions the door recorded since the last read: (id, reason, latency in µs)."""
    with contextlib.closing(sqlite3.connect(door.ledger)) as conn:
        rows = conn.execute(
            "SELECT id, reason, latency_us FROM admission_decisions WHERE id > ? ORDER BY id",
            (door.mark,),
        ).fetchall()
    if rows:
        door.mark = rows[-1][0]
    return [(int(r[0]), str(r[1]), int(r[2])) for r in rows]


# -- pure costs --------------------------------------------------------------------------------


def pure_costs_of(tree: Path, sizes: list[int]) -> dict[str, Any]:
    """``loadtests.fleetcosts`` run on ``tree``'s code, in a process of its own, before
    anything else of the run is started."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtests.fleetcosts", *map(str, sizes)],
        env={**os.environ, "PYTHONPATH": tree_path(tree)},
        # `python -m` puts the working directory first on the path, before PYTHONPATH.
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# -- one step --------------------------------------------------------------------------------


def per_s(value: float, seconds: float) -> float:
    return value / seconds if seconds > 0 else 0.0


@dataclass
class Rates:
    """CPU shares (CPU seconds a second), Redis commands and pull requests a second in a
    quiet window: the background that an admission or a call window is measured above."""

    cpu: dict[str, float]
    redis: dict[str, float]
    pulls: float

    @classmethod
    def of(cls, span: Span) -> Rates:
        return cls(
            {name: per_s(span.cpu(name), span.seconds) for name in span.after.cpu},
            {name: per_s(v, span.seconds) for name, v in span.redis_calls().items()},
            per_s(span.count("pull_requests"), span.seconds),
        )


async def wait_visible(doors: list[Door], n: int, bound_s: float) -> float:
    """Seconds until every front door's fleet view holds ``n`` live workers."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as client:
        while True:
            seen = [await live_workers(door, client) for door in doors]
            if all(s >= n for s in seen):
                return time.monotonic() - started
            if time.monotonic() - started > bound_s:
                raise TimeoutError(f"only {seen} of {n} workers live after {bound_s:.0f} s")
            await asyncio.sleep(0.5)


async def quiet(meter: Meter, seconds: float) -> Span:
    before = meter.read()
    await asyncio.sleep(seconds)
    return Span(before, meter.read())


def quiet_report(
    span: Span, idle: Rates, doors: list[Door], n: int, tiers: dict[str, Any]
) -> dict[str, Any]:
    s = span.seconds
    beats = per_s(span.heartbeats, s)
    rates = Rates.of(span)

    def per_beat_us(component: str) -> float | None:
        if beats <= 0:
            return None
        return round((rates.cpu[component] - idle.cpu[component]) / beats * 1e6, 1)

    return {
        "seconds": round(s, 2),
        "heartbeats_per_s": round(beats, 1),
        "doors": {
            d.label: {
                "cpu_share": round(rates.cpu[f"door_{d.label}"], 4),
                "cpu_us_per_heartbeat": per_beat_us(f"door_{d.label}"),
            }
            for d in doors
        },
        "nats_cpu_share": round(rates.cpu["nats"], 4),
        "nats_cpu_us_per_heartbeat": per_beat_us("nats"),
        "workers_cpu_share": round(rates.cpu["workers"], 4),
        "worker_cpu_ms_per_s": round(rates.cpu["workers"] / n * 1000, 3) if n else None,
        "redis_calls_per_s": round(sum(rates.redis.values()), 1),
        "pull_requests_per_s": round(per_s(span.count("pull_requests"), s), 1),
        "pull_answers_per_s": {
            key.removeprefix("status_"): round(per_s(span.count(key), s), 2)
            for key in ("status_408", "status_409", "status_404", "status_100")
        },
        "refused_max_waiting": span.count("refused_max_waiting"),
        "consumers": tiers,
        "machine_busy_share": span.machine_busy_share,
    }


async def admission(
    meter: Meter, door: Door, background: Rates, args: argparse.Namespace
) -> dict[str, Any]:
    """The open loop on one door, then a pause in which its sessions idle out and are swept
    and its ledger rows are written; Redis commands and CPU above the quiet background."""
    ledger_rows(door)
    before = meter.read()
    run = await open_loop(door, args.admit_rate, args.admit_s)
    await asyncio.sleep(SWEEP_PAUSE_S)
    span = Span(before, meter.read())
    rows = ledger_rows(door)
    decisions = len(rows)
    latency = stats.summary([r[2] for r in rows], (50, 99), ndigits=0)
    calls = span.redis_calls()
    above = {
        name: (v - background.redis.get(name, 0.0) * span.seconds) / max(decisions, 1)
        for name, v in calls.items()
    }
    key = f"door_{door.label}"
    door_cpu = span.cpu(key) - background.cpu[key] * span.seconds
    return {
        **run,
        "decisions": decisions,
        "reasons": dict(Counter(r[1] for r in rows)),
        "server_p50_us": latency["p50"],
        "server_p99_us": latency["p99"],
        "redis_calls_per_admission": round(sum(above.values()), 2),
        "redis_by_command": {k: round(v, 2) for k, v in above.items() if abs(v) >= 0.05},
        "door_cpu_ms_per_admission": round(door_cpu / max(decisions, 1) * 1000, 3),
        "machine_busy_share": span.machine_busy_share,
    }


async def calls(
    meter: Meter, door: Door, background: Rates, nc: NATS, args: argparse.Namespace
) -> dict[str, Any]:
    """The closed loop of plain calls on one door; each component's CPU per call above the
    quiet background."""
    ledger_rows(door)
    before = meter.read()
    run = await closed_loop(door, args.call_clients, args.call_s, args.call_tokens, nc)
    span = Span(before, meter.read())
    rows = ledger_rows(door)
    done: int = max(run["calls"], 1)

    def cpu_ms(component: str) -> float:
        used = span.cpu(component) - background.cpu[component] * span.seconds
        return round(used / done * 1000, 3)

    redis_calls = sum(span.redis_calls().values()) - sum(background.redis.values()) * span.seconds
    latency = stats.summary([r[2] for r in rows], (50, 99), ndigits=0)
    return {
        **run,
        "decision_p50_us": latency["p50"],
        "decision_p99_us": latency["p99"],
        "cpu_ms_per_call": {
            "door": cpu_ms(f"door_{door.label}"),
            "nats": cpu_ms("nats"),
            "workers": cpu_ms("workers"),
            "redis": cpu_ms("redis"),
            "harness": cpu_ms("harness"),
        },
        "redis_calls_per_call": round(redis_calls / done, 2),
        "pull_requests_per_call": round(
            (span.count("pull_requests") - background.pulls * span.seconds) / done, 3
        ),
        "refused_max_waiting": span.count("refused_max_waiting"),
        "machine_busy_share": span.machine_busy_share,
    }


# -- the run ----------------------------------------------------------------------------------


async def provision(nats_url: str) -> None:
    """The streams, the model's tier consumers and the workers bucket at three replicas,
    before anyone else starts (every worker and front door would, at its own start)."""
    from broker.settings import StreamSettings
    from broker.streams import provision_calls, provision_results, workers_bucket

    settings = StreamSettings(replicas=3)
    nc = await nats.connect(servers=nats_url.split(","))
    try:
        js = nc.jetstream(timeout=10)
        await provision_calls(js, settings, MODEL)
        await provision_results(js, settings)
        await workers_bucket(js, settings)
    finally:
        await nc.close()


@contextlib.contextmanager
def servers(work: Path) -> Iterator[tuple[Cluster, OwnRedis]]:
    cluster = Cluster(work / "nats")
    own_redis: OwnRedis | None = None
    try:
        cluster.start()
        own_redis = OwnRedis(work / "redis")
        yield cluster, own_redis
    finally:
        if own_redis is not None:
            own_redis.stop()
        cluster.stop()


@contextlib.asynccontextmanager
async def system(
    work: Path, trees: dict[str, Path], args: argparse.Namespace
) -> AsyncIterator[tuple[Meter, NATS]]:
    with servers(work) as (cluster, own_redis):
        await cluster.wait_ready()
        await provision(cluster.url)
        env = {
            "KVGATE_NATS_URL": cluster.url,
            "KVGATE_REDIS_URL": own_redis.url,
            "KVGATE_STREAM_REPLICAS": "3",
            "KVGATE_SERVED_MODEL_NAME": MODEL,
            "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        }
        doors: list[Door] = []
        shape = WorkerShape(
            args.heartbeat_s,
            args.seqs,
            args.kv_tokens,
            args.step_s,
            args.start_rate,
            args.host_size,
        )
        fleet = Fleet(work, cluster.url, shape)
        nc = await nats.connect(servers=cluster.url.split(","))
        try:
            for label, tree in trees.items():
                doors.append(await asyncio.to_thread(start_door, label, tree, work, env))
            await count_heartbeats(nc, fleet)
            yield Meter(cluster, own_redis, doors, fleet), nc
        finally:
            await nc.close()
            fleet.stop()
            for door in doors:
                door.proc.stop()


async def rehearse(args: argparse.Namespace, work: Path, trees: dict[str, Path]) -> dict[str, Any]:
    summary: dict[str, Any] = {"pure": {}, "steps": []}
    for label, tree in trees.items():
        summary["pure"][label] = await asyncio.to_thread(pure_costs_of, tree, args.pure_sizes)
        log(f"pure costs, {label}: {json.dumps(summary['pure'][label])}")
    async with system(work, trees, args) as (meter, nc):
        idle_span = await quiet(meter, args.quiet_s)
        idle = Rates.of(idle_span)
        summary["idle"] = {
            "seconds": round(idle_span.seconds, 2),
            "cpu_share": {k: round(v, 4) for k, v in idle.cpu.items()},
            "redis_calls_per_s": round(sum(idle.redis.values()), 1),
        }
        log(f"no workers: {json.dumps(summary['idle'])}")
        warmed = False
        for index, n in enumerate(args.sizes):
            # Each door goes first in every other step: neither always meets the other's wake.
            doors = meter.doors if index % 2 == 0 else meter.doors[::-1]
            started = time.monotonic()
            meter.fleet.grow(n)
            bound = START_BOUND_S + n * 0.5
            visible_s = await wait_visible(meter.doors, n, bound)
            step: dict[str, Any] = {"workers": n, "grow_s": round(time.monotonic() - started, 1)}
            step["visible_s"] = round(visible_s, 1)
            await asyncio.sleep(SETTLE_S)
            span = await quiet(meter, args.quiet_s)
            background = Rates.of(span)
            tiers = await consumers(nc)
            step["quiet"] = quiet_report(span, idle, meter.doors, n, tiers)
            log(f"N={n} quiet: {json.dumps(step['quiet'])}")
            if not warmed:
                for door in doors:  # connections, Redis scripts loaded: not counted
                    await open_loop(door, 50, 1)
                await asyncio.sleep(SWEEP_PAUSE_S)
                warmed = True
            step["admission"] = {}
            for door in doors:
                step["admission"][door.label] = await admission(meter, door, background, args)
                log(f"N={n} admission {door.label}: {json.dumps(step['admission'][door.label])}")
            step["calls"] = {}
            for door in doors:
                step["calls"][door.label] = await calls(meter, door, background, nc, args)
                log(f"N={n} calls {door.label}: {json.dumps(step['calls'][door.label])}")
                await asyncio.sleep(1.0)
            step["rss_mib"] = {
                "doors": {d.label: rss_mib(d.pid) for d in meter.doors},
                "nats": [rss_mib(pid) for pid in meter.cluster.pids],
                "workers": round(sum(rss_mib(pid) for pid in meter.fleet.pids), 1),
            }
            step["fleet"] = {
                k: v for k, v in meter.fleet.counts().items() if k in ("workers", "crashed")
            }
            summary["steps"].append(step)
    summary["per_heartbeat_fit"] = per_heartbeat_fit(summary["steps"], list(trees))
    return summary


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x; ``None`` with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def per_heartbeat_fit(steps: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """CPU per heartbeat as the slope of each process's quiet CPU share against the heartbeat
    rate, over the steps whose quiet window left the machine under half busy: steadier than
    one window's share over its heartbeats, which a 10 ms clock tick blurs at small N."""
    calm = [s for s in steps if s["quiet"]["machine_busy_share"] < 0.5]

    def fit(share: Any) -> float | None:
        points = [(s["quiet"]["heartbeats_per_s"], share(s["quiet"])) for s in calm]
        found = slope(points)
        return None if found is None else round(found * 1e6, 1)

    return {
        "steps": [s["workers"] for s in calm],
        "doors_us": {lb: fit(lambda q, lb=lb: q["doors"][lb]["cpu_share"]) for lb in labels},
        "nats_us": fit(lambda q: q["nats_cpu_share"]),
        "workers_us": fit(lambda q: q["workers_cpu_share"]),
    }


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    nats_server = subprocess.run(
        [find_binary(), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    redis_server = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "nats-server": nats_server,
        "redis-server": redis_server,
        "nats-py": version("nats-py"),
        "aiohttp": version("aiohttp"),
    }


# -- the command -------------------------------------------------------------------------------


def sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.rehearsal",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="the run folder")
    p.add_argument(
        "--sizes",
        type=sizes,
        default=[25, 50, 100, 200, 400, 600],
        help="fleet sizes, comma-separated, growing",
    )
    p.add_argument("--host-size", type=int, default=100, help="most workers in one process")
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=2.0,
        help="workers' heartbeat interval (the worker's default)",
    )
    p.add_argument("--seqs", type=int, default=16, help="sequences per simulated engine")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV tokens per simulated engine")
    p.add_argument("--step-s", type=float, default=0.002, help="simulated decode step")
    p.add_argument(
        "--start-rate", type=float, default=25.0, help="workers started a second in each process"
    )
    p.add_argument("--quiet-s", type=float, default=10.0, help="heartbeats-only window")
    p.add_argument("--admit-rate", type=float, default=100.0, help="sessions/s, open loop")
    p.add_argument("--admit-s", type=float, default=5.0, help="admission window")
    p.add_argument("--call-clients", type=int, default=32, help="closed-loop callers")
    p.add_argument("--call-s", type=float, default=8.0, help="call window")
    p.add_argument("--call-tokens", type=int, default=8, help="max_tokens of each call")
    p.add_argument(
        "--pure-sizes",
        type=sizes,
        default=[25, 100, 400, 1000, 4000],
        help="fleet sizes for the in-process per-message costs",
    )
    p.add_argument(
        "--compare-tree",
        type=Path,
        help="another kvgate source tree: its front door runs beside this one's",
    )
    p.add_argument("--compare-label", default="before", help="that door's name in the results")
    p.add_argument(
        "--label",
        default="after",
        help="this tree's door's name in the results (with --compare-tree)",
    )
    p.add_argument("--work", type=Path, help="logs and stores (default: a temporary folder)")
    return p


def manifest_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    given = {
        a.dest
        for a in p._actions
        for opt in a.option_strings
        for word in sys.argv[1:]
        if word == opt or word.startswith(opt + "=")
    }
    params = {
        a.dest: {
            "value": str(v) if isinstance(v := getattr(args, a.dest), Path) else v,
            "from": "command line" if a.dest in given else "default",
            "meaning": a.help,
        }
        for a in p._actions
        if a.dest != "help"
    }
    busy_before = machine_busy()
    time.sleep(1)
    busy_after = machine_busy()
    return {
        "command": "python -m loadtests.rehearsal " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parameters": params,
        "fixed": {
            "nats": "3 servers, one machine, loopback; streams, consumers and the workers "
            "bucket at 3 replicas",
            "redis": "a redis-server of the run's own, no persistence",
            "ledger": "SQLite, one file per front door",
            "tenancy": "no tenants file: the open development tenant, standard tier",
            "session": SESSION,
            "settle_s": SETTLE_S,
            "worker_settings": "the worker's defaults but heartbeat_interval_s (pull_expires_s "
            "10, ack_wait 30 s)",
        },
        "versions": versions(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
            "busy_share_at_start": round(
                (busy_after[0] - busy_before[0]) / max(busy_after[1] - busy_before[1], 1), 3
            ),
        },
    }


def main() -> None:
    p = parser()
    args = p.parse_args()
    trees = {args.label if args.compare_tree else "current": REPO}
    if args.compare_tree is not None:
        trees = {args.compare_label: args.compare_tree.resolve(), **trees}
    manifest = manifest_of(p, args)
    manifest["trees"] = {label: which_tree(tree) for label, tree in trees.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    with contextlib.ExitStack() as stack:
        work = args.work or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-rehearsal-"))
        )
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        summary = asyncio.run(rehearse(args, work, trees))
    summary["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report.write(args.out, summary, manifest)
    log(f"wrote {args.out} in {summary['wall_s']} s")


if __name__ == "__main__":
    main()
