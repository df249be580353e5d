"""A worker on the simulated engine: in-process, serving until the test is done, or as a
process of its own that a test can kill."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from broker.procs import Proc
from tests.polling import wait_ready
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker, WorkerCounters


@contextlib.asynccontextmanager
async def sim_worker(
    engine: SimEngine, nats_url: str, worker_id: str, *, ready_at: str, **settings: Any
) -> AsyncIterator[Worker]:
    """Run a worker on ``engine``; yields once the front door at ``ready_at`` sees it.
    ``settings``: further ``WorkerSettings`` fields (``stream``, ``drain_grace_s``...)."""
    given: dict[str, Any] = {"pull_expires_s": 2, "heartbeat_interval_s": 0.3, **settings}
    worker = Worker(engine, WorkerSettings(nats_url=nats_url, worker_id=worker_id, **given))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(ready_at)
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)


async def _serve_alone() -> WorkerCounters:
    engine = SimEngine(SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192))
    worker = Worker(engine, WorkerSettings())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    await worker.run()
    return worker.counters


def main() -> None:
    """``python -m tests.simworker COUNTERS``: a worker on the simulated engine in a process of
    its own, so that a test can kill it (``kvgate worker`` runs vLLM only). Its settings come
    from the ``KVGATE_*`` variables, as ``kvgate worker``'s do; on SIGTERM it drains as
    ``kvgate worker`` does, then writes its final counters to COUNTERS, as JSON."""
    logging.basicConfig(level=logging.INFO)
    counters = asyncio.run(_serve_alone())
    Path(sys.argv[1]).write_text(json.dumps(dataclasses.asdict(counters)))


def start_sim_worker(nats_url: str, log_dir: Path, name: str, **env: str) -> tuple[Proc, Path]:
    """A simulated worker process named ``name``; the process and where its final counters
    will be."""
    counters = log_dir / f"{name}-counters.json"
    proc = Proc(
        f"worker-{name}",
        [sys.executable, "-m", "tests.simworker", str(counters)],
        {"KVGATE_NATS_URL": nats_url, "KVGATE_WORKER_WORKER_ID": name, **env},
        log_dir,
    )
    return proc, counters


if __name__ == "__main__":
    main()
