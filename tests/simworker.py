"""An in-process worker on the simulated engine, serving until the test is done."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from tests.polling import poll_until
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine
from workers.worker import Worker


@contextlib.asynccontextmanager
async def sim_worker(
    engine: SimEngine, nats_url: str, worker_id: str, *, ready_at: str
) -> AsyncIterator[Worker]:
    """Run a worker on ``engine``; yields once the front door at ``ready_at`` sees it."""
    worker = Worker(
        engine,
        WorkerSettings(
            nats_url=nats_url, worker_id=worker_id, pull_expires_s=2, heartbeat_interval_s=0.3
        ),
    )
    task = asyncio.create_task(worker.run())
    try:
        async with httpx.AsyncClient(base_url=ready_at) as client:
            await poll_until(
                lambda: client.get("/readyz"), lambda r: r.status_code == 200, timeout_s=20
            )
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)
