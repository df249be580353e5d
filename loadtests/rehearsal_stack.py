"""The rehearsal's system under test and its meters (``loadtests/rehearsal.py``): a
three-server NATS cluster, a Redis of its own, front doors from one or two source trees, the
worker hosts (``loadtests/fleethost.py``), and readings of everything they use: CPU per process
from ``/proc``, Redis's ``INFO commandstats``, the hosts' pull counters, and the heartbeats a
plain subscriber sees entering the workers bucket."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from nats.aio.client import Client as NATS

from broker.natsserver import LocalCluster
from broker.procs import Proc, free_port, wait_http
from kvgate.cli import COMMAND
from schemas.vocab import TIERS_BY_PRIORITY
from schemas.wire import STREAM_NAME, WORKERS_BUCKET, consumer_name

MODEL = "kvgate-sim"
ADMIN_TOKEN = "rehearsal-admin"
REPO = Path(__file__).resolve().parents[1]
START_BOUND_S = 60.0
"""For the cluster to elect its JetStream meta leader, a front door to answer, Redis to start."""


# -- /proc -----------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def machine_busy() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot; steal counts as busy."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


# -- servers ---------------------------------------------------------------------------------


class Cluster(LocalCluster):
    """The rehearsal's three JetStream servers, routed to each other on loopback."""

    def __init__(self, root: Path, size: int = 3) -> None:
        super().__init__(root, size=size, name="kvgate-rehearsal")


class OwnRedis:
    """A ``redis-server`` of the run's own on a free port, without persistence, so that its
    ``INFO commandstats`` counts only this run's commands."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = Proc(
            "redis",
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""],
            {},
            root,
            cwd=root,
        )
        self.client = redis.Redis.from_url(self.url, socket_timeout=5)
        deadline = time.monotonic() + START_BOUND_S
        while True:
            try:
                self.client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or not self.proc.alive():
                    raise RuntimeError(f"redis did not start:\n{self.proc.tail()}") from None
                time.sleep(0.05)

    def commands(self) -> dict[str, int]:
        """Calls per command so far (``INFO commandstats``), the ``info`` asking excluded."""
        raw = self.client.info("commandstats")
        return {
            name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in raw.items()
            if name != "cmdstat_info"
        }

    def version(self) -> str:
        return str(self.client.info("server")["redis_version"])

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()


@dataclass
class Door:
    """One front door (``kvgate api``), from this tree or from ``--compare-tree``."""

    label: str
    tree: Path
    proc: Proc
    base: str
    ledger: Path
    mark: int = 0
    """The last ledger row already read."""

    @property
    def pid(self) -> int:
        return self.proc.pid


def tree_path(tree: Path) -> str:
    """``PYTHONPATH`` for code from ``tree``: its packages first, then this tree's for what it
    lacks (the load harness itself)."""
    return os.pathsep.join(dict.fromkeys([str(tree), str(REPO)]))


def start_door(label: str, tree: Path, root: Path, env: dict[str, str]) -> Door:
    port = free_port()
    ledger = root / f"ledger-{label}.db"
    proc = Proc(
        f"api-{label}",
        [*COMMAND, "--log-level", "WARNING", "api", "--port", str(port)],
        {
            **env,
            "PYTHONPATH": tree_path(tree),
            "KVGATE_REDIS_PREFIX": f"{{kvgate-rehearsal-{label}-{uuid.uuid4().hex[:8]}}}",
            "KVGATE_DATABASE_URL": f"sqlite:///{ledger}",
        },
        root,
        # `python -m` puts the working directory first on the path, before PYTHONPATH.
        cwd=tree,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", proc, timeout=START_BOUND_S)
    return Door(label, tree, proc, base, ledger)


def which_tree(tree: Path) -> str:
    """The file the front door's fleet view is imported from under ``tree``'s path: proof of
    which code a door runs."""
    env = {**os.environ, "PYTHONPATH": tree_path(tree)}
    out = subprocess.run(
        [sys.executable, "-c", "import broker.fleet as f; print(f.__file__)"],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


# -- counting ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerShape:
    """Every simulated worker's settings (``loadtests/fleethost.py``)."""

    heartbeat_s: float
    seqs: int
    kv_tokens: int
    step_s: float
    start_rate: float
    host_size: int
    """The most workers in one process."""

    def flags(self) -> list[str]:
        return [
            f"--heartbeat-s={self.heartbeat_s}",
            f"--seqs={self.seqs}",
            f"--kv-tokens={self.kv_tokens}",
            f"--step-s={self.step_s}",
            f"--start-rate={self.start_rate}",
        ]


@dataclass
class Fleet:
    """The worker hosts started so far, and the heartbeats seen entering the bucket."""

    root: Path
    nats_url: str
    shape: WorkerShape
    hosts: list[tuple[Proc, Path]] = field(default_factory=list)
    size: int = 0
    heartbeats: int = 0

    def grow(self, to: int) -> None:
        """Start hosts for the workers missing up to ``to``; they start on their own pace."""
        while self.size < to:
            k = min(self.shape.host_size, to - self.size)
            name = f"h{len(self.hosts):02d}"
            stats_path = self.root / f"{name}.json"
            proc = Proc(
                name,
                [
                    *(sys.executable, "-m", "loadtests.fleethost", f"--workers={k}"),
                    *(f"--name={name}", f"--stats={stats_path}", f"--nats-url={self.nats_url}"),
                    *self.shape.flags(),
                ],
                {"KVGATE_STREAM_REPLICAS": "3", "PYTHONPATH": str(REPO)},
                self.root,
                cwd=REPO,
            )
            self.hosts.append((proc, stats_path))
            self.size += k

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self.hosts if proc.alive()]

    def counts(self) -> Counter[str]:
        """The hosts' counters, summed (pull requests, their answers, workers started)."""
        total: Counter[str] = Counter()
        for proc, path in self.hosts:
            if not proc.alive():
                raise RuntimeError(f"worker host {proc.name} exited:\n{proc.tail()}")
            with contextlib.suppress(OSError, json.JSONDecodeError):
                data = json.loads(path.read_text())
                data.pop("at", None)
                total.update({k: int(v) for k, v in data.items()})
        return total

    def stop(self) -> None:
        for proc, _ in self.hosts:
            proc.signal(signal.SIGTERM)
        for proc, _ in self.hosts:
            proc.stop(timeout=40)


@dataclass
class Reading:
    """Everything counted at one instant: CPU seconds per component, the fleet's counters,
    Redis's commands, the wall clock and the machine's busy ticks."""

    at: float
    cpu: dict[str, float]
    fleet: Counter[str]
    heartbeats: int
    redis: dict[str, int]
    busy: tuple[int, int]


@dataclass
class Meter:
    cluster: Cluster
    redis: OwnRedis
    doors: list[Door]
    fleet: Fleet

    def read(self) -> Reading:
        cpu = {f"door_{d.label}": cpu_s(d.pid) for d in self.doors}
        cpu["nats"] = sum(cpu_s(pid) for pid in self.cluster.pids)
        cpu["redis"] = cpu_s(self.redis.proc.pid)
        cpu["workers"] = sum(cpu_s(pid) for pid in self.fleet.pids)
        cpu["harness"] = cpu_s(os.getpid())
        return Reading(
            time.monotonic(),
            cpu,
            self.fleet.counts(),
            self.fleet.heartbeats,
            self.redis.commands(),
            machine_busy(),
        )


@dataclass(frozen=True)
class Span:
    """What happened between two readings."""

    before: Reading
    after: Reading

    @property
    def seconds(self) -> float:
        return self.after.at - self.before.at

    def cpu(self, component: str) -> float:
        return self.after.cpu[component] - self.before.cpu[component]

    def count(self, name: str) -> int:
        return self.after.fleet[name] - self.before.fleet[name]

    @property
    def heartbeats(self) -> int:
        return self.after.heartbeats - self.before.heartbeats

    def redis_calls(self) -> dict[str, int]:
        names = set(self.after.redis) | set(self.before.redis)
        delta = {n: self.after.redis.get(n, 0) - self.before.redis.get(n, 0) for n in names}
        return {n: v for n, v in sorted(delta.items()) if v}

    @property
    def machine_busy_share(self) -> float:
        busy = self.after.busy[0] - self.before.busy[0]
        total = self.after.busy[1] - self.before.busy[1]
        return round(busy / max(total, 1), 3)


async def count_heartbeats(nc: NATS, fleet: Fleet) -> None:
    """Every put into the workers bucket, as a plain subscriber on its subjects sees it."""

    async def seen(_msg: Any) -> None:
        fleet.heartbeats += 1

    await nc.subscribe(f"$KV.{WORKERS_BUCKET}.>", cb=seen)


async def consumers(nc: NATS) -> dict[str, dict[str, int | None]]:
    """Each tier consumer's waiting pull requests, acks pending and calls pending."""
    js = nc.jetstream(timeout=5)
    out: dict[str, dict[str, int | None]] = {}
    for tier in TIERS_BY_PRIORITY:
        info = await js.consumer_info(STREAM_NAME, consumer_name(tier, MODEL))
        out[tier.value] = {
            "num_waiting": info.num_waiting,
            "num_ack_pending": info.num_ack_pending,
            "num_pending": info.num_pending,
            "max_waiting": info.config.max_waiting,
        }
    return out


async def live_workers(door: Door, client: aiohttp.ClientSession) -> int:
    """Workers this front door's fleet view holds with a fresh heartbeat."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with client.get(door.base + "/v1/admin/workers", headers=headers) as resp:
        body = await resp.json()
    return sum(1 for w in body["workers"] if not w["stale"])
