"""The front door's view of the worker fleet, kept current from the ``KVGATE_WORKERS`` bucket.

A reading older than ``max_age_s`` is not a live worker: a stale heartbeat means "unknown",
never "idle". ``FleetView`` is plain data (the admission policy reads it without I/O);
``FleetWatcher`` feeds it from a KV watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.js.kv import KeyValue

from broker.tables import text_table
from schemas.wire import WorkerHeartbeat, decode_heartbeat

log = logging.getLogger(__name__)


class FleetView:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_ms = int(max_age_s * 1000)
        self._workers: dict[str, WorkerHeartbeat] = {}
        self._tokens_per_s: dict[str, float] = {}

    def update(self, key: str, value: bytes | None) -> None:
        """Apply one bucket entry; ``None`` (a delete) removes the worker."""
        if value is None:
            self._workers.pop(key, None)
            self._tokens_per_s.pop(key, None)
            return
        try:
            heartbeat = decode_heartbeat(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("ignoring malformed heartbeat under key %r", key)
            return
        previous = self._workers.get(key)
        if previous is not None and heartbeat.sent_ms > previous.sent_ms:
            produced = heartbeat.generated_tokens - previous.generated_tokens
            if produced >= 0:  # a restarted worker starts its counter again
                seconds = (heartbeat.sent_ms - previous.sent_ms) / 1000
                self._tokens_per_s[key] = produced / seconds
        self._workers[key] = heartbeat

    def tokens_per_s(self, worker_id: str) -> float | None:
        """Output tokens per second between the worker's last two heartbeats."""
        return self._tokens_per_s.get(worker_id)

    def all(self) -> list[WorkerHeartbeat]:
        """Every worker with an entry, stale ones included (the policy sees their age)."""
        return list(self._workers.values())

    def live(self, now_ms: int) -> list[WorkerHeartbeat]:
        """Workers whose last heartbeat is fresh, draining ones included."""
        return [hb for hb in self._workers.values() if now_ms - hb.sent_ms <= self.max_age_ms]

    def serving(self, now_ms: int) -> list[WorkerHeartbeat]:
        return [hb for hb in self.live(now_ms) if not hb.draining]


class FleetWatcher:
    def __init__(self, kv: KeyValue, view: FleetView) -> None:
        self._kv = kv
        self.view = view
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        self._watcher = await self._kv.watchall()
        self._task = asyncio.create_task(self._run(self._watcher))

    async def _run(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # end of the initial values
                continue
            deleted = entry.operation in ("DEL", "PURGE")
            self.view.update(entry.key, None if deleted else entry.value)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()  # type: ignore[no-untyped-call]


async def read_fleet(kv: KeyValue, max_age_s: float) -> FleetView:
    """A one-off snapshot of the bucket (for the CLI); the front door keeps a watch instead."""
    from nats.js.errors import NoKeysError

    view = FleetView(max_age_s)
    try:
        keys = await kv.keys()
    except NoKeysError:
        return view
    for key in keys:
        with contextlib.suppress(Exception):
            entry = await kv.get(key)
            view.update(key, entry.value)
    return view


def workers_table(workers: list[WorkerHeartbeat], now_ms: int) -> str:
    """Live workers as a fixed-width text table."""
    header = ("WORKER", "MODEL", "KV", "RUNNING", "WAITING", "STAGED", "PREEMPT", "STATE", "AGE")
    return text_table(
        header,
        [
            (
                hb.worker_id,
                hb.model,
                "-" if hb.kv_cache_usage is None else f"{hb.kv_cache_usage:.0%}",
                f"{hb.num_running}/{hb.max_num_seqs}",
                str(hb.num_waiting),
                str(hb.staged),
                str(hb.num_preemptions),
                "draining" if hb.draining else "serving",
                f"{(now_ms - hb.sent_ms) / 1000:.1f}s",
            )
            for hb in sorted(workers, key=lambda h: h.worker_id)
        ],
    )
