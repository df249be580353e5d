"""What one tick of the batch runner reads from the database: what changed since the last
tick, not the whole batch. A real runner (real NATS, real session admission, a real SQLite
database), ticked by hand; results are written to the lines as the collector writes them.

Counted, not timed: every row SQLite hands to the runner's connections."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry
from sqlalchemy import event

from api.batches import store
from api.batches.request import ParsedLine
from api.batches.runner import BatchRunner
from api.batches.store import LineStatus
from broker.admission.admitter import Admitter
from broker.admission.metrics import AdmissionMetrics
from broker.admission.signals import FleetSignals
from broker.admission.state import MemoryAdmissionState
from broker.admission.tenants import DEV_TENANT_ID, load_tenancy
from broker.db import make_engine, migrate, utcnow
from broker.fleet import FleetView
from broker.natsserver import EmbeddedNats
from broker.publisher import CallPublisher
from broker.settings import ApiSettings
from broker.streams import provision_calls, provision_results
from loadtests.heartbeats import idle_heartbeat
from schemas.vocab import Tier
from schemas.wire import STREAM_NAME, consumer_name, encode
from tests.batches import write_batch
from tests.calls import MODEL, chat_body
from tests.polling import poll_until

LINES = 3000
"""One session of this many lines, run one after another."""
ROWS_PER_TICK = 10
"""A tick that starts the next line reads its claim, the lines running now and the next line's
body: a handful of rows, however long the batch. Reading the batch's lines is thousands."""


@dataclass
class Harness:
    settings: ApiSettings
    db_url: str
    db: Path
    fleet: FleetView
    admitter: Admitter
    nc: NATS
    js: JetStreamContext
    queue: JetStreamContext.PullSubscription
    """The batch tier's queue, as a worker pulls it."""
    rows: list[int]
    """Rows read by the runners' connections so far (one counter)."""

    async def queue_drained(self) -> None:
        """Until admission reads an empty queue (a backlog counts against admitting more)."""

        async def pending() -> int | None:
            await asyncio.sleep(0.05)
            by_tier = self.admitter.signals.pending_by_tier(int(time.time() * 1000))
            return None if by_tier is None else sum(by_tier.values())

        await poll_until(pending, lambda n: n == 0, timeout_s=10)

    def runner(self, **settings: Any) -> BatchRunner:
        """A runner on its own connection to the database, as a front door has."""
        engine = make_engine(self.db_url)

        @event.listens_for(engine, "connect")
        def _count_rows(conn: sqlite3.Connection, _: Any) -> None:
            def counted(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> tuple[Any, ...]:
                self.rows[0] += 1
                return row

            conn.row_factory = counted

        return BatchRunner(
            self.settings.model_copy(update=settings),
            engine,
            self.admitter,
            CallPublisher(self.js),
            self.nc,
            self.js,
        )

    async def tick(self, runner: BatchRunner) -> int:
        """One tick of ``runner`` (with the fleet fresh); the rows it read."""
        self.fleet.update("w1", encode(idle_heartbeat("w1", capacity=1 << 20)))
        before = self.rows[0]
        await runner.tick()
        return self.rows[0] - before

    def running(self, batch_id: str) -> list[int]:
        with sqlite3.connect(self.db) as conn:
            return [
                n
                for (n,) in conn.execute(
                    "SELECT line_no FROM batch_lines WHERE batch_id = ? AND status = 'running'"
                    " ORDER BY line_no",
                    (batch_id,),
                )
            ]

    async def answer_running(self, batch_id: str) -> None:
        """Take the queued calls off the queue, as a worker does, and write a result to every
        running line, as the collector does."""
        with contextlib.suppress(TimeoutError):
            for msg in await self.queue.fetch(100, timeout=0.5):
                await msg.ack()
        engine = make_engine(self.db_url)
        try:
            with sqlite3.connect(self.db) as conn:
                call_ids = [
                    c
                    for (c,) in conn.execute(
                        "SELECT call_id FROM batch_lines WHERE batch_id = ? AND status = 'running'",
                        (batch_id,),
                    )
                ]
            result = {"status_code": 200, "body": {"answer": "ok"}}
            store.finish_lines(
                engine, [(c, LineStatus.COMPLETED, result, None) for c in call_ids], utcnow()
            )
        finally:
            engine.dispose()


@asynccontextmanager
async def harness(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Harness]:
    db = tmp_path / "kvgate.db"
    db_url = f"sqlite:///{db}"
    migrate(db_url)
    settings = ApiSettings(nats_url=nats_server.url, database_url=db_url)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision_calls(js, settings.stream, model=MODEL)
    queue = await js.pull_subscribe_bind(consumer_name(Tier.BESTEFFORT, MODEL), stream=STREAM_NAME)
    await provision_results(js, settings.stream)
    fleet = FleetView(settings.heartbeat_max_age_s)
    signals = FleetSignals(fleet)
    signals.start(js, interval_s=0.2)
    admitter = Admitter(
        settings,
        load_tenancy(None, Tier.STANDARD),
        MemoryAdmissionState(),
        signals,
        AdmissionMetrics(CollectorRegistry()),
        None,
        shared=False,
    )
    try:
        # Admission counts an unread queue lag as no room: wait for the first reading.
        await poll_until(lambda: asyncio.sleep(0, signals.lag), bool, timeout_s=10)
        yield Harness(settings, db_url, db, fleet, admitter, nc, js, queue, [0])
    finally:
        await signals.stop()
        await nc.close()


def store_session(db_url: str, lines: int) -> str:
    """A batch of the development tenant: one session of ``lines`` lines. Its id."""
    parsed = [
        ParsedLine(n, f"c{n}", "agent", False, chat_body(f"step {n}", 4))
        for n in range(1, lines + 1)
    ]
    return write_batch(db_url, DEV_TENANT_ID, parsed)


@pytest.mark.timeout(120)
async def test_a_tick_reads_what_changed_not_the_whole_batch(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with harness(nats_server, tmp_path) as h:
        batch_id = store_session(h.db_url, LINES)
        first = h.runner()
        await h.tick(first)  # reads the batch once, admits its session, starts its first line
        assert h.running(batch_id) == [1]
        reads = []
        for n in range(2, 12):
            await h.answer_running(batch_id)
            reads.append(await h.tick(first))
            assert h.running(batch_id) == [n]  # the next line, once the one before ended
        assert max(reads) <= ROWS_PER_TICK, reads
        print("rows read per tick:", reads)

        # A front door that takes the batch over (the first one went silent) reads it again
        # from the database: it does not start the line still running, nor the next one before
        # that line ends.
        second = h.runner(batch_runner_stale_s=0.001)
        await h.tick(second)
        assert h.running(batch_id) == [11]
        await h.tick(second)
        assert h.running(batch_id) == [11]
        await h.answer_running(batch_id)
        await h.queue_drained()
        await h.tick(second)  # admits the session anew: sized from its open lines, once
        assert h.running(batch_id) == [12]
        await h.answer_running(batch_id)
        assert await h.tick(second) <= ROWS_PER_TICK
        assert h.running(batch_id) == [13]
        counts = store.line_counts(make_engine(h.db_url), batch_id)
        assert counts[LineStatus.COMPLETED.value] == 12
        assert counts[LineStatus.PENDING.value] == LINES - 13
