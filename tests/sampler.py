"""Watch worker heartbeats from a test: the engine's own readings, as operators see them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats

from broker.fleet import FleetView, FleetWatcher
from broker.settings import StreamSettings
from broker.streams import workers_bucket
from schemas.wire import WorkerHeartbeat


@dataclass
class Peaks:
    kv_cache_usage: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    samples: int = 0
    last: dict[str, WorkerHeartbeat] = field(default_factory=dict)


class FleetSampler:
    def __init__(self, view: FleetView) -> None:
        self.view = view
        self.peaks = Peaks()

    def workers(self) -> list[WorkerHeartbeat]:
        import time

        return self.view.live(int(time.time() * 1000))

    async def wait_for(self, n: int, timeout: float = 10.0) -> list[WorkerHeartbeat]:
        """Until ``n`` live workers are seen (the watch delivers the bucket asynchronously)."""
        async with asyncio.timeout(timeout):
            while len(live := self.workers()) < n:  # noqa: ASYNC110 - heartbeats are polled
                await asyncio.sleep(0.05)
        return live

    def reset(self) -> None:
        self.peaks = Peaks()

    async def run(self, interval: float = 0.05) -> None:
        while True:
            for hb in self.workers():
                p = self.peaks
                p.kv_cache_usage = max(p.kv_cache_usage, hb.kv_cache_usage or 0.0)
                p.num_waiting = max(p.num_waiting, hb.num_waiting)
                p.num_running = max(p.num_running, hb.num_running)
                p.samples += 1
                p.last[hb.worker_id] = hb
            await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def sample_fleet(
    nats_url: str, *, workers: int = 1, timeout: float = 10.0
) -> AsyncIterator[FleetSampler]:
    nc = await nats.connect(nats_url)
    kv = await workers_bucket(nc.jetstream(), StreamSettings())
    watcher = FleetWatcher(kv, FleetView(max_age_s=3))
    await watcher.start()
    sampler = FleetSampler(watcher.view)
    task = asyncio.create_task(sampler.run())
    try:
        await sampler.wait_for(workers, timeout)
        yield sampler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await watcher.stop()
        await nc.close()
