"""An in-process worker on the simulated engine, serving until the test is done."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.polling import wait_ready
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine
from workers.worker import Worker


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
