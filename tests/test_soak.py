"""The soak (issue 14): the chaos suite's mixed load for a while, with a Redis restart and a
worker restart along the way, then its accounting, and every process's resident memory at the
start and at the end.

In the suite it runs ``KVGATE_SOAK_MINUTES`` (3) minutes; ``make soak`` runs 30 and writes its
report (``KVGATE_SOAK_REPORT``, JSON) for docs/reliability.md. Real processes: the front door,
NATS and a Redis of the test's own; the worker runs in this process on the simulated engine (no
command starts a simulated worker), so its memory is this process's, load client included, and
is reported but not held to the bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

from broker.natsserver import EmbeddedNats
from tests.chaos import (
    API_KEY,
    MixedLoad,
    Rest,
    chaos_front_door,
    check_answers,
    check_batch,
    summary,
    wait_for_zero,
)
from tests.procs import mib, resident_bytes
from tests.sampler import sample_fleet
from tests.servers import RedisServer
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker

SOAK_S = float(os.environ.get("KVGATE_SOAK_MINUTES", "3")) * 60
WARMUP_SHARE = 0.15
RETENTION_S = 20.0
"""How long ended sessions' records are kept here (``KVGATE_SESSION_RETENTION_S``, 600 s by
default): the admission state grows by the sessions ended within it, then holds."""
WARMUP_S = max(SOAK_S * WARMUP_SHARE, 2 * RETENTION_S)
"""The first memory reading waits this long: a process's heap grows to its working size first
(imports, pools, caches, the retained records), and that growth is not a leak."""
RSS_GROWTH = 0.10
RSS_SLACK_BYTES = 8 << 20
""""Flat within 10%": a process's resident memory at the end is at most 10% above its reading
after the warm-up, or 8 MiB, whichever is more (a process of 10 MiB moves by more than 10% from
allocator noise alone)."""
WORKER_STOP_BOUND_S = 60.0
"""For the worker to drain its running calls and exit."""
READY_BOUND_S = 30.0


class Workers:
    """The in-process simulated worker, restartable; what the retired ones ended is kept, so
    that "every call published ended once" still adds up across the restart."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.retired_ended = 0
        self._runs = 0
        self._worker: Worker | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._runs += 1
        engine = SimEngine(SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192))
        settings = WorkerSettings(
            nats_url=self.nats_url,
            worker_id=f"sim-soak-{self._runs}",
            pull_expires_s=2,
            heartbeat_interval_s=0.3,
        )
        self._worker = Worker(engine, settings)
        self._task = asyncio.create_task(self._worker.run())

    async def stop(self) -> None:
        """SIGTERM's path: drain (running calls finish, staged ones go back), then exit."""
        assert self._worker is not None and self._task is not None
        self._worker.request_stop()
        await asyncio.wait_for(self._task, WORKER_STOP_BOUND_S)
        counters = self._worker.counters
        self.retired_ended += counters.ended
        self._worker = self._task = None


async def test_a_soak_with_a_redis_and_a_worker_restart_holds_memory_and_loses_nothing(
    tmp_path: Path, nats_server: EmbeddedNats, redis_server: RedisServer
) -> None:
    with chaos_front_door(
        tmp_path,
        nats_server.url,
        redis_server.url,
        KVGATE_SESSION_RETENTION_S=str(RETENTION_S),
    ) as (proc, base):
        workers = Workers(nats_server.url)
        workers.start()
        async with sample_fleet(nats_server.url, timeout=READY_BOUND_S) as fleet:
            rest = Rest(base, nats_server.url, fleet, redis_server.url)
            load = MixedLoad(base, API_KEY)
            started = time.monotonic()
            await load.start()

            def pids() -> dict[str, int]:
                assert nats_server.pid is not None
                return {
                    "front door": proc.pid,
                    "nats-server": nats_server.pid,
                    "redis-server": redis_server.pid,
                    "test process (load client, in-process worker)": os.getpid(),
                }

            await load.run_for(WARMUP_S)
            first = {name: resident_bytes(pid) for name, pid in pids().items()}
            await load.run_for(SOAK_S * 0.3)
            redis_server.stop()  # SIGTERM: it saves its data set, and loads it again
            redis_server.start()
            await load.run_for(SOAK_S * 0.25)
            await workers.stop()
            workers.start()
            await fleet.wait_for(1, READY_BOUND_S)
            await load.run_for(max(0.0, SOAK_S - (time.monotonic() - started)))
            last = {name: resident_bytes(pid) for name, pid in pids().items()}
            await load.stop()
            elapsed_s = time.monotonic() - started

            faults = check_answers(load.outcomes)
            batch = await check_batch(load)
            rest.gone_ended = (workers.retired_ended, workers.retired_ended)
            settled_s, readings = await wait_for_zero(rest)
        await workers.stop()

    errors = Counter(o.code for o in load.outcomes if o.code is not None)
    report = {
        "soak_s": round(elapsed_s, 1),
        "requests": len(load.outcomes),
        "answered": sum(1 for o in load.outcomes if o.ok),
        "errors_by_code": dict(errors),
        "faults": faults,
        "batch_lines": batch["request_counts"]["completed"],
        "calls_published": readings["js_calls_published"],
        "back_to_zero_s": round(settled_s, 2),
        "resident_mib": {
            name: {"after_warmup": mib(first[name]), "end": mib(last[name])} for name in first
        },
    }
    print(f"\nsoak: {json.dumps(report, indent=2)}\n{summary(load.outcomes)}")
    if path := os.environ.get("KVGATE_SOAK_REPORT"):
        with open(path, "w") as out:  # noqa: ASYNC230 (once, at the end)
            out.write(json.dumps(report, indent=2) + "\n")
    assert faults == []
    held = {
        name: (first[name], last[name])
        for name in first
        if not name.startswith("test process")
        and last[name] > max(first[name] * (1 + RSS_GROWTH), first[name] + RSS_SLACK_BYTES)
    }
    assert held == {}, f"resident memory grew past the bound: {held}"
