"""The front door's view of the worker fleet, kept current from the ``KVGATE_WORKERS`` bucket.

A reading older than ``max_age_s`` is not a live worker: a stale heartbeat means "unknown",
never "idle". ``FleetView`` is plain data (the admission policy reads it without I/O);
``FleetWatcher`` feeds it from a KV watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec
from nats.js.kv import KeyValue

from broker.text_tables import text_table
from schemas.wire import WorkerHeartbeat, decode_heartbeat

log = logging.getLogger(__name__)


# How long a per-sequence speed reading counts towards a worker's fastest recent speed.
SPEED_WINDOW_MS = 60_000
# The shortest span a speed is measured over. A busy worker beats every half second or so
# (``WorkerSettings.reading_interval_s``); over so short a span, the running count at its two
# ends says little of the sequences between them, and the fastest of the minute's readings
# would be an outlier, not a speed a session can count on.
SPEED_SPAN_MS = 1_500


FORGOTTEN_AFTER_MS = 10 * 60 * 1000


class FleetView:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_ms = int(max_age_s * 1000)
        self._workers: dict[str, WorkerHeartbeat] = {}
        self._speeds: dict[str, deque[tuple[int, float]]] = {}
        self._span_start: dict[str, WorkerHeartbeat] = {}
        """Each worker's heartbeat that the speed span now being measured began with."""
        # The fastest of each worker's readings, kept here because every admission decision
        # reads it and heartbeats arrive far less often than decisions.
        self._fastest: dict[str, float] = {}
        self.members = 0
        """Counts changes to who is in the view and what it serves: a worker added or removed,
        a model or a draining flag changed. A heartbeat that only refreshes a reading leaves it
        as it is (``FleetSignals`` reuses its readings while it stands)."""

    def update(self, key: str, value: bytes | None) -> None:
        """Apply one bucket entry; ``None`` (a delete) removes the worker."""
        if value is None:
            if self._workers.pop(key, None) is not None:
                self.members += 1
            self._speeds.pop(key, None)
            self._span_start.pop(key, None)
            self._fastest.pop(key, None)
            return
        try:
            heartbeat = decode_heartbeat(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("ignoring malformed heartbeat under key %r", key)
            return
        previous = self._workers.get(key)
        start = self._span_start.setdefault(key, heartbeat)
        if heartbeat.sent_ms < start.sent_ms:
            self._span_start[key] = heartbeat  # the worker's clock went back: begin again
        elif heartbeat.sent_ms - start.sent_ms >= SPEED_SPAN_MS:
            self._measure_speed(key, start, heartbeat)
            self._span_start[key] = heartbeat
        if (
            previous is None
            or previous.draining != heartbeat.draining
            or previous.model != heartbeat.model
        ):
            self.members += 1
        self._workers[key] = heartbeat

    def _measure_speed(self, key: str, before: WorkerHeartbeat, now: WorkerHeartbeat) -> None:
        """Decode speed per sequence over one span of heartbeats, counted only when the engine
        ran calls at both ends of it: an interval that was idle for most of its length would
        read as a crawl and get sessions rejected as unable to meet their deadlines."""
        produced = now.generated_tokens - before.generated_tokens
        if produced <= 0 or not before.num_running or not now.num_running:
            return  # idle, or a restarted worker whose counter began again
        seconds = (now.sent_ms - before.sent_ms) / 1000
        sequences = (before.num_running + now.num_running) / 2
        readings = self._speeds.setdefault(key, deque())
        readings.append((now.sent_ms, produced / seconds / sequences))
        while readings and readings[0][0] < now.sent_ms - SPEED_WINDOW_MS:
            readings.popleft()
        self._fastest[key] = max(speed for _, speed in readings)

    def seq_tokens_per_s(self, worker_id: str) -> float | None:
        """The fastest decode speed per sequence the worker showed over the last minute
        (tokens per second of one sequence); None before it has run calls long enough."""
        return self._fastest.get(worker_id)

    def all(self) -> list[WorkerHeartbeat]:
        """Every worker with an entry, stale ones included (the policy sees their age)."""
        return list(self._workers.values())

    def recent(self, now_ms: int) -> list[WorkerHeartbeat]:
        """Workers heard from within ``FORGOTTEN_AFTER_S``, stale ones included: what operators
        are shown. A worker that died keeps its entry here (a bucket key that expires sends
        no delete to the watch), so past that it is shown no more."""
        return [hb for hb in self._workers.values() if now_ms - hb.sent_ms <= FORGOTTEN_AFTER_MS]

    def live(self, now_ms: int) -> list[WorkerHeartbeat]:
        """Workers whose last heartbeat is fresh, draining ones included."""
        return [hb for hb in self._workers.values() if now_ms - hb.sent_ms <= self.max_age_ms]

    def serving(self, now_ms: int) -> list[WorkerHeartbeat]:
        return [hb for hb in self.live(now_ms) if not hb.draining]

    def models(self, now_ms: int) -> dict[str, list[WorkerHeartbeat]]:
        """Each model the serving workers serve, with those workers."""
        served: dict[str, list[WorkerHeartbeat]] = {}
        for hb in self.serving(now_ms):
            served.setdefault(hb.model, []).append(hb)
        return served

    def known_models(self) -> set[str]:
        """Every model a worker in the bucket serves, stale and draining ones included: a
        model whose workers are restarting is still this fleet's (calls to it wait or are
        deferred, not refused as unknown). An entry leaves with its worker's TTL."""
        return {hb.model for hb in self._workers.values()}


RETRY_S = 1.0
"""Pause before the watch is opened again after it failed (no JetStream yet after a restart)."""


class FleetWatcher:
    """Feeds a ``FleetView`` from a watch on the workers bucket, reopened whenever it fails
    and whenever ``reopen()`` says the connection came back: the bucket is kept in memory, so
    a NATS server restart loses it (the workers put it back with their next heartbeat, or
    ``open_bucket`` does), and a watch on the old one would wait for ever."""

    def __init__(self, open_bucket: Callable[[], Awaitable[KeyValue]], view: FleetView) -> None:
        self._open_bucket = open_bucket
        self.view = view
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the first watch (its errors are the caller's), then keep one open."""
        first = await (await self._open_bucket()).watchall()
        self._task = asyncio.create_task(self._run(first))

    def reopen(self) -> None:
        """Drop the current watch and open a new one (after a reconnect)."""
        if self._watch is not None:
            self._watch.cancel()

    async def _run(self, first: KeyValue.KeyWatcher | None) -> None:
        watcher = first
        this = asyncio.current_task()
        assert this is not None
        while True:
            pause = RETRY_S
            try:
                if watcher is None:
                    watcher = await (await self._open_bucket()).watchall()
                self._watch = asyncio.create_task(self._follow(watcher))
                try:
                    await self._watch
                except asyncio.CancelledError:
                    if this.cancelling():
                        raise  # stop()
                    pause = 0.0  # reopen(): at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("the workers bucket could not be watched: %r; retrying", exc)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
                watcher = None
            # A watch that ended by itself, or failed, is reopened after a pause, so a server
            # that keeps refusing is not asked in a tight loop.
            await asyncio.sleep(pause)

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
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
