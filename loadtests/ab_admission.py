"""Admission throughput of two checkouts of kvgate, side by side on one machine, interleaved.

On a shared machine the host's fast and slow phases move one benchmark run by a factor of two
(``bench_admission``'s closed loop gave 2,000 sessions/s one session and 900 the next, on the
same code). Comparing two commits run after one another then measures the host. Here both
front doors run at once (one NATS, one Redis, prefixes and ledgers of their own, the same
heartbeat of an idle fleet), and the load alternates between them in short slices, in an order
that flips every round, so each phase falls on both alike. Per checkout: sessions admitted per
second of its slices (closed loop, ``POST /v1/sessions``) and the CPU time its front-door
process spent per session (from ``/proc``: what the code costs, whatever the wall clock did).
The ratios B/A of each repeat are the result.

    .venv/bin/python -m loadtests.ab_admission --a /tmp/wt-old --b . --repeats 5 \\
        --out loadtests/results/admission-ab.json

``--a`` and ``--b`` are checkouts (``git worktree add --detach /tmp/wt-old <commit>``); each
front door runs with its checkout first on ``PYTHONPATH``, under this environment's Python.
With ``--rate R`` each slice is an open loop at R sessions/s instead (the arrival rate
``bench_admission`` holds its latency target at), and each side's p50/p99 latency is compared.
Needs Redis on 127.0.0.1:6379. About 30 s per repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import nats

from broker.admission.redis_store import RedisAdmissionState
from broker.natsserver import EmbeddedNats
from broker.procs import Proc, free_port, wait_http
from kvgate.cli import COMMAND
from loadtests import stats
from loadtests.bench_admission import SESSION, client_collections_paused, paced
from loadtests.heartbeats import keep_beating
from schemas.wire import WORKERS_BUCKET


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def commit_of(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


async def open_loop(
    base: str, seconds: float, rate: float, latencies: list[float], statuses: dict[int, int]
) -> int:
    """Sessions asked for at ``rate`` per second for ``seconds``, whatever the answers'
    latency; each answer's latency (ms) is appended to ``latencies``, its status counted in
    ``statuses`` (a refusal is an answer too: it is timed, not raised)."""
    admitted = 0
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(base, connector=connector) as client:

        async def one() -> None:
            nonlocal admitted
            started = time.perf_counter()
            async with client.post("/v1/sessions", json=SESSION) as resp:
                await resp.read()
            latencies.append((time.perf_counter() - started) * 1000)
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            admitted += resp.status == 201

        await paced(rate, int(rate * seconds), one)
    return admitted


async def closed_loop(base: str, seconds: float, concurrency: int) -> int:
    """Sessions admitted by ``concurrency`` clients, each asking again at once, for ``seconds``."""
    admitted = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base, connector=connector) as client:
        stop_at = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal admitted
            while time.perf_counter() < stop_at:
                async with client.post("/v1/sessions", json=SESSION) as resp:
                    await resp.read()
                    resp.raise_for_status()
                admitted += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return admitted


@asynccontextmanager
async def front_doors(
    root: Path, checkouts: dict[str, Path], redis_url: str
) -> AsyncIterator[dict[str, tuple[Proc, str]]]:
    server = EmbeddedNats(root / "nats", log_file=root / "nats.log").start()
    doors: dict[str, tuple[Proc, str]] = {}
    prefixes = {name: f"{{kvgate-ab-{name}-{uuid.uuid4().hex[:8]}}}" for name in checkouts}
    nc = None
    beat_task: asyncio.Task[None] | None = None
    try:
        for name, checkout in checkouts.items():
            port = free_port()
            proc = Proc(
                f"api-{name}",
                [*COMMAND, "--log-level", "WARNING", "api", "--port", str(port)],
                {
                    "PYTHONPATH": str(checkout.resolve()),
                    "KVGATE_NATS_URL": server.url,
                    "KVGATE_REDIS_URL": redis_url,
                    "KVGATE_REDIS_PREFIX": prefixes[name],
                    "KVGATE_DATABASE_URL": f"sqlite:///{root / name}.db",
                },
                root,
                # `python -m` puts the working directory first on the path, before PYTHONPATH.
                cwd=checkout.resolve(),
            )
            doors[name] = (proc, f"http://127.0.0.1:{port}")
        for proc, base in doors.values():
            await asyncio.to_thread(wait_http, base + "/healthz", proc, timeout=60)
        nc = await nats.connect(server.url)
        kv = await nc.jetstream().key_value(WORKERS_BUCKET)

        beat_task = asyncio.create_task(
            keep_beating(kv, "ab", 10**9, max_num_seqs=256, interval_s=0.5)
        )
        for proc, base in doors.values():
            await asyncio.to_thread(wait_http, base + "/readyz", proc, timeout=30)
        yield doors
    finally:
        if beat_task is not None:
            beat_task.cancel()
        if nc is not None:
            await nc.close()
        for proc, _ in doors.values():
            proc.stop()
        server.stop()
        for prefix in prefixes.values():  # the sessions the run left in the shared Redis
            store = RedisAdmissionState(redis_url, prefix=prefix)
            await store.delete_all()
            await store.close()


async def one_repeat(
    doors: dict[str, tuple[Proc, str]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """One repeat: ``args.rounds`` slices of each door, closed loop or, with ``--rate``, open
    loop at that rate (then the answers' latency percentiles too)."""
    totals = {name: {"sessions": 0.0, "seconds": 0.0, "cpu_s": 0.0} for name in doors}
    latencies: dict[str, list[float]] = {name: [] for name in doors}
    statuses: dict[str, dict[int, int]] = {name: {} for name in doors}
    for i in range(args.rounds):
        order = sorted(doors) if i % 2 == 0 else sorted(doors, reverse=True)
        for name in order:
            proc, base = doors[name]
            with client_collections_paused():
                cpu_before, started = cpu_s(proc.pid), time.perf_counter()
                if args.rate:
                    admitted = await open_loop(
                        base, args.slice_s, args.rate, latencies[name], statuses[name]
                    )
                else:
                    admitted = await closed_loop(base, args.slice_s, args.concurrency)
                totals[name]["seconds"] += time.perf_counter() - started
            totals[name]["cpu_s"] += cpu_s(proc.pid) - cpu_before
            totals[name]["sessions"] += admitted
    out: dict[str, dict[str, Any]] = {}
    for name, t in totals.items():
        out[name] = {
            "sessions": int(t["sessions"]),
            "sessions_per_s": round(t["sessions"] / t["seconds"], 1),
            "cpu_ms_per_session": round(1000 * t["cpu_s"] / max(t["sessions"], 1), 4),
        }
        if args.rate:
            cuts = stats.summary(latencies[name], (50, 99), ndigits=2)
            out[name].update(p50_ms=cuts["p50"], p99_ms=cuts["p99"], statuses=statuses[name])
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"a": args.a, "b": args.b}
    with tempfile.TemporaryDirectory(prefix="kvgate-ab-") as tmp:
        async with front_doors(Path(tmp), checkouts, args.redis_url) as doors:
            for _, base in doors.values():  # warm up both before anything counts
                await closed_loop(base, 1.0, args.concurrency)
            repeats = []
            for _ in range(args.repeats):
                result: dict[str, Any] = await one_repeat(doors, args)
                result["ratio_b_over_a"] = {
                    key: round(result["b"][key] / result["a"][key], 3) for key in _compared(args)
                }
                print(json.dumps(result), flush=True)
                repeats.append(result)
    ratios = {
        key: stats.summary([r["ratio_b_over_a"][key] for r in repeats], (50,), ndigits=3)
        for key in _compared(args)
    }
    return {
        "command": " ".join(["python -m loadtests.ab_admission", *sys.argv[1:]]),
        "a": {"checkout": str(args.a), "commit": commit_of(args.a)},
        "b": {"checkout": str(args.b), "commit": commit_of(args.b)},
        "rounds": args.rounds,
        "slice_s": args.slice_s,
        "concurrency": None if args.rate else args.concurrency,
        "rate": args.rate,
        "repeats": repeats,
        "median_ratio_b_over_a": {key: value["p50"] for key, value in ratios.items()},
    }


def _compared(args: argparse.Namespace) -> tuple[str, ...]:
    if args.rate:
        return ("cpu_ms_per_session", "p50_ms", "p99_ms")
    return ("sessions_per_s", "cpu_ms_per_session")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="the baseline checkout")
    parser.add_argument("--b", type=Path, required=True, help="the checkout compared with it")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6, help="slices of each per repeat")
    parser.add_argument("--slice-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32, help="closed loop's clients")
    parser.add_argument(
        "--rate", type=float, help="open loop at this many sessions/s instead of a closed loop"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result["median_ratio_b_over_a"]))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
