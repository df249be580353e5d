"""Watch worker heartbeats from a test: the engine's own readings, as operators see them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from broker import natsconn
from broker.fleet import FleetView, FleetWatcher
from broker.settings import StreamSettings
from broker.streams import workers_bucket
from schemas.wire import WorkerHeartbeat
from tests.polling import poll_until

SAMPLE_INTERVAL_S = 0.05
"""How often the fleet's readings are sampled and polled: well under the test workers'
heartbeat interval (0.2 to 0.5 s), so that no reading is missed."""


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
        return self.view.live(int(time.time() * 1000))

    async def until(
        self, done: Callable[[list[WorkerHeartbeat]], bool], timeout: float
    ) -> list[WorkerHeartbeat]:
        """The live workers' readings, once ``done`` holds for them (the watch delivers the
        bucket asynchronously: heartbeats are polled)."""

        async def read() -> list[WorkerHeartbeat]:
            return self.workers()

        return await poll_until(read, done, timeout_s=timeout, interval_s=SAMPLE_INTERVAL_S)

    async def wait_for(self, n: int, timeout: float = 10.0) -> list[WorkerHeartbeat]:
        """Until ``n`` live workers are seen."""
        return await self.until(lambda live: len(live) >= n, timeout)

    async def beat_after(self, sent_ms: int, timeout: float) -> WorkerHeartbeat:
        """The first worker's first reading sent after ``sent_ms`` (wall-clock milliseconds,
        as heartbeats are stamped): one that shows what happened before ``sent_ms``."""
        live = await self.until(lambda live: bool(live) and live[0].sent_ms > sent_ms, timeout)
        return live[0]

    def reset(self) -> None:
        self.peaks = Peaks()

    async def run(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        while True:
            for hb in self.workers():
                p = self.peaks
                p.kv_cache_usage = max(p.kv_cache_usage, hb.kv_cache_usage or 0.0)
                p.num_waiting = max(p.num_waiting, hb.num_waiting)
                p.num_running = max(p.num_running, hb.num_running)
                p.samples += 1
                p.last[hb.worker_id] = hb
            await asyncio.sleep(interval)  # sampling: a peak is no event to await


@contextlib.asynccontextmanager
async def sample_fleet(
    nats_url: str, *, workers: int = 1, timeout: float = 10.0
) -> AsyncIterator[FleetSampler]:
    nc = await natsconn.connect(nats_url)
    js = nc.jetstream()
    watcher = FleetWatcher(lambda: workers_bucket(js, StreamSettings()), FleetView(max_age_s=3))
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
