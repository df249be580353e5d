"""Admission benchmarks.

1. Policy: ``broker.admission.decide`` in-process on a realistic snapshot (8 workers, a tenant
   with sessions held, nothing queued, so that every decision runs all seven checks), timed
   one decision at a time: p50/p99.
2. HTTP: ``POST /v1/sessions`` against one front-door process (``kvgate api``, real uvicorn)
   with Redis admission state and the SQLite ledger on, at a fixed open-loop arrival rate
   (default 500 sessions/s), then closed-loop at a fixed concurrency for the rate one process
   sustains. Client-side latency is the full HTTP round trip; server-side latency is the
   decision time each ledger row records (signals, policy, Redis reservation).

The fleet is a heartbeat with ample capacity (no engine is needed to decide), and sessions
idle out after 2 s, so the state stays at steady size. Run:

    .venv/bin/python -m loadtests.bench_admission --out loadtests/results/admission.json

(about 1 minute). Each HTTP run also reports the machine's load around it (load average, share
of all cores busy): on a shared machine the tail follows the neighbours. Needs Redis on
127.0.0.1:6379 (``--redis-url``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from broker.admission.policy import (
    AdmissionPolicy,
    FleetSnapshot,
    Holdings,
    Pressure,
    SessionNeed,
    WorkerReading,
    decide,
)
from broker.admission.tenants import DEFAULT_TIERS, Tenant
from kvgate.cli import COMMAND
from loadtests import stats
from schemas.vocab import Tier

if TYPE_CHECKING:
    from broker.procs import Proc


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot, from ``/proc/stat``; ``None``
    where there is none. Steal counts as busy: a neighbour on the host took that time."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@contextlib.contextmanager
def machine_load(into: dict[str, Any]) -> Iterator[None]:
    """Disclose what else ran: the 1-minute load average before and after, and the share of
    all cores busy during the block (the benchmark's own client and server included)."""
    before, load_before = cpu_ticks(), os.getloadavg()[0]
    yield
    after = cpu_ticks()
    into["machine_load"] = {
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "cpu_busy_share": (
            round((after[0] - before[0]) / max(after[1] - before[1], 1), 3)
            if before and after
            else None
        ),
    }


@contextlib.contextmanager
def client_collections_paused(paused: bool = True) -> Iterator[None]:
    """No cyclic garbage collection in this process, the client, while a timed phase runs.

    The client's event loop times every answer. A full collection of its heap (28-43 ms on
    the 2-core machine, seen with ``gc.callbacks``, every 10-20 s) paused it in the middle of
    a run, and the answers it was then waiting for, and the burst it sent late after it, were
    counted as the front door's latency: a 500/s run in which one fell had its worst answer at
    45 ms, p99 6.1 ms; three that it missed 7.7-14 ms and 3.2-4.2 ms. A phase of seconds
    leaves little garbage; it is collected after. ``paused=False`` keeps the collector on, as
    before, for comparison."""
    if not paused:
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def bench_policy(decisions: int) -> dict[str, Any]:
    workers = tuple(
        WorkerReading(
            worker_id=f"w{i}",
            kv_usage=0.4 + 0.05 * i,
            kv_capacity_tokens=200_000,
            running=20 + i,
            waiting=0,
            max_num_seqs=64,
            seq_tokens_per_s=40.0 + i,
            age_s=0.3 * i,
        )
        for i in range(8)
    )
    fleet = FleetSnapshot(workers, {Tier.GUARANTEED: 0, Tier.STANDARD: 0, Tier.BESTEFFORT: 0})
    holdings = Holdings(
        reserved_by_tier={Tier.GUARANTEED: 200_000, Tier.STANDARD: 500_000, Tier.BESTEFFORT: 10},
        tenant_sessions=12,
        tenant_parallel=80,
        tenant_tokens_this_minute=1_000_000,
        released_tokens_per_s=25_000.0,
    )
    tenant = Tenant(id="acme", key_sha256="a" * 64, max_tier=Tier.GUARANTEED)
    policy = AdmissionPolicy(tiers=DEFAULT_TIERS)
    needs = [
        SessionNeed(tier, 8, 24, 1_500, 300, 600.0)
        for tier in (Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT)
    ]
    timings: list[float] = []
    outcomes: dict[str, int] = {}
    clock = time.perf_counter_ns
    for i in range(decisions):
        need = needs[i % 3]
        started = clock()
        d = decide(
            need, tenant, fleet, holdings, Pressure.NORMAL, policy, max_age_s=6.0, jitter=0.5
        )
        timings.append((clock() - started) / 1000)
        outcomes[d.reason.value] = outcomes.get(d.reason.value, 0) + 1
    cuts = stats.summary(timings, (50, 99), ndigits=2)
    return {
        "decisions": decisions,
        "p50_us": cuts["p50"],
        "p99_us": cuts["p99"],
        "mean_us": round(statistics.fmean(timings), 2),
        "outcomes": outcomes,
    }


def start_api(root: Path, name: str, nats_url: str, env: dict[str, str]) -> tuple[Proc, str, Path]:
    """Start ``kvgate api`` (real uvicorn, warnings only in its log ``root/<name>.log``) on a
    free port with a SQLite ledger of its own, ``root/<name>-ledger.db``; ``env`` adds to its
    environment (``KVGATE_REDIS_URL``...). Returns at once, with its base URL and its ledger:
    the caller waits for ``/healthz``."""
    from broker.procs import Proc, free_port
    from loadtests.targets import CODE_UNDER_TEST_ENV

    ledger = root / f"{name}-ledger.db"
    port = free_port()
    api = Proc(
        name,
        [*COMMAND, "--log-level", "WARNING", "api", "--port", str(port)],
        {
            "KVGATE_NATS_URL": nats_url,
            "KVGATE_DATABASE_URL": f"sqlite:///{ledger}",
            **CODE_UNDER_TEST_ENV,
            **env,
        },
        root,
    )
    return api, f"http://127.0.0.1:{port}", ledger


async def paced(rate: float, total: int, one: Callable[[], Coroutine[Any, Any, None]]) -> float:
    """Start ``total`` runs of ``one`` at ``rate`` a second, whatever their latency (open
    loop), then wait for all of them; the seconds the offering took (the answers may take
    longer)."""
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    offered_s = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    return offered_s


@contextlib.asynccontextmanager
async def front_door(root: Path, redis_url: str, prefix: str) -> AsyncIterator[tuple[str, Path]]:
    import nats

    from broker.natsserver import EmbeddedNats
    from broker.procs import wait_http
    from loadtests.heartbeats import keep_beating
    from schemas.wire import WORKERS_BUCKET

    server = EmbeddedNats(root / "nats", log_file=root / "nats.log").start()
    api, base, ledger = start_api(
        root, "api", server.url, {"KVGATE_REDIS_URL": redis_url, "KVGATE_REDIS_PREFIX": prefix}
    )
    nc = await nats.connect(server.url)
    beat_task: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(wait_http, base + "/healthz", api, timeout=60)
        kv = await nc.jetstream().key_value(WORKERS_BUCKET)

        beat_task = asyncio.create_task(
            keep_beating(kv, "bench", 10**9, max_num_seqs=256, interval_s=0.5)
        )
        await asyncio.to_thread(wait_http, base + "/readyz", api, timeout=30)
        yield base, ledger
    finally:
        if beat_task is not None:
            beat_task.cancel()
        await nc.close()
        api.stop()
        server.stop()


SESSION = {
    "tier": "standard",
    "max_parallel": 4,
    "expected_calls": 12,
    "est_prompt_tokens": 800,
    "est_output_tokens": 200,
    "idle_timeout_s": 2,
}


async def open_loop(base: str, rate: float, seconds: float) -> dict[str, Any]:
    """Arrivals at a fixed rate, whatever the answers' latency (an open system)."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(base, connector=connector) as client:

        async def one() -> None:
            started = time.perf_counter()
            async with client.post("/v1/sessions", json=SESSION) as resp:
                await resp.read()
            latencies.append((time.perf_counter() - started) * 1000)
            statuses[resp.status] = statuses.get(resp.status, 0) + 1

        total = int(rate * seconds)
        t0 = time.perf_counter()
        offered_s = await paced(rate, total, one)
        elapsed = time.perf_counter() - t0
    cuts = stats.summary(latencies, (50, 99), ndigits=2)
    return {
        "offered_rate": rate,
        "sessions": total,
        "achieved_offer_rate": round(total / offered_s, 1),
        "completed_rate": round(total / elapsed, 1),
        "statuses": statuses,
        "p50_ms": cuts["p50"],
        "p99_ms": cuts["p99"],
        "max_ms": round(max(latencies), 2),
    }


async def closed_loop(base: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` clients each sending the next request as soon as the last is answered."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base, connector=connector) as client:
        stop_at = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                async with client.post("/v1/sessions", json=SESSION) as resp:
                    await resp.read()
                    resp.raise_for_status()
                latencies.append((time.perf_counter() - started) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    cuts = stats.summary(latencies, (50, 99), ndigits=2)
    return {
        "concurrency": concurrency,
        "sessions": len(latencies),
        "sessions_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": cuts["p50"],
        "p99_ms": cuts["p99"],
    }


def ledger_rows(ledger: Path, since_id: int) -> tuple[list[tuple[float, str]], int]:
    """The decision time (us) and the decision (admit, defer, reject) of every ledger row
    after ``since_id``, and the last row's id (``since_id`` where there is none)."""
    with sqlite3.connect(ledger) as conn:
        rows = conn.execute(
            "SELECT id, latency_us, decision FROM admission_decisions WHERE id > ?", (since_id,)
        ).fetchall()
    last = max((r[0] for r in rows), default=since_id)
    return [(float(r[1]), str(r[2])) for r in rows], last


def server_side(ledger: Path, since_id: int) -> tuple[dict[str, Any], int]:
    rows, last = ledger_rows(ledger, since_id)
    values = [latency for latency, _ in rows]
    if not values:
        return {"decisions": 0}, last
    cuts = stats.summary(values, (50, 99), ndigits=0)
    return {"decisions": len(values), "p50_us": cuts["p50"], "p99_us": cuts["p99"]}, last


async def bench_http(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"{{kvgate-bench-{uuid.uuid4().hex[:8]}}}"
    from broker.admission.redis_store import RedisAdmissionState

    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        async with front_door(Path(tmp), args.redis_url, prefix) as (base, ledger):
            await open_loop(base, 50, 2)  # warm-up: connections, first Redis script load
            await asyncio.sleep(2.5)  # the warm-up's ledger rows are written
            _, mark = server_side(ledger, 0)
            results: dict[str, Any] = {"open_loop": [], "closed_loop": None}
            for rate in args.rates:
                load: dict[str, Any] = {}
                with machine_load(load), client_collections_paused(not args.client_gc):
                    run = await open_loop(base, rate, args.seconds)
                run.update(load)
                await asyncio.sleep(1.0)
                run["server"], mark = server_side(ledger, mark)
                results["open_loop"].append(run)
                print(json.dumps(run), file=sys.stderr)
                await asyncio.sleep(2.5)  # sessions idle out between runs
            load = {}
            with machine_load(load), client_collections_paused(not args.client_gc):
                closed = await closed_loop(base, args.concurrency, args.seconds)
            closed.update(load)
            await asyncio.sleep(1.0)
            closed["server"], mark = server_side(ledger, mark)
            results["closed_loop"] = closed
            print(json.dumps(closed), file=sys.stderr)
    store = RedisAdmissionState(args.redis_url, prefix=prefix)
    await store.delete_all()
    await store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/admission.json"))
    parser.add_argument("--decisions", type=int, default=200_000)
    parser.add_argument("--rates", type=float, nargs="+", default=[250.0, 500.0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--client-gc",
        action="store_true",
        help="leave the client's garbage collector on while a phase is timed (the behaviour "
        "before it was paused; for comparison)",
    )
    args = parser.parse_args()

    report: dict[str, Any] = {
        "command": "python -m loadtests.bench_admission " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "policy": bench_policy(args.decisions),
    }
    print(json.dumps(report["policy"]), file=sys.stderr)
    report["http"] = asyncio.run(bench_http(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
