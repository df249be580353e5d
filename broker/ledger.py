"""The ledger: every admission decision, with the signals it saw, in SQL (SQLModel).

SQLite file by default, PostgreSQL with ``KVGATE_DATABASE_URL``; the engine, the schema's
migrations and the clock rows are stamped with are ``broker.db``'s.

Writes never sit on the request path: ``record`` puts the entry on a bounded queue and returns;
a background task writes batches from a worker thread. When the queue is full (the database is
slow or down) the entry is dropped and counted (``dropped``, exported as a metric), because a
stalled audit log must not stall admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Integer, insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Field, Session, SQLModel, select

from broker.db import make_engine, migrate

log = logging.getLogger(__name__)


class AdmissionRecord(SQLModel, table=True):
    __tablename__ = "admission_decisions"

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    )
    decided_at: datetime = Field(index=True)
    replica: str = Field(max_length=64)
    tenant: str = Field(max_length=64)
    tier: str = Field(max_length=16)
    scope: str = Field(max_length=16)
    """``session`` (POST /v1/sessions) or ``call`` (a call with no session)."""
    session_id: str | None = Field(default=None, max_length=64)
    decision: str = Field(max_length=16)
    reason: str = Field(max_length=32)
    retry_after_s: int | None = None
    latency_us: int
    signals: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


_TABLE = AdmissionRecord.__table__  # type: ignore[attr-defined]


@dataclass
class LedgerEntry:
    """One decision as queued: plain data, cheap to build on the request path (the ORM row
    is only the table's definition; batches go in as one multi-row insert)."""

    decided_at: datetime
    replica: str
    tenant: str
    tier: str
    scope: str
    session_id: str | None
    decision: str
    reason: str
    retry_after_s: int | None
    latency_us: int
    signals: dict[str, Any]


class Ledger:
    def __init__(
        self,
        url: str,
        *,
        max_queue: int = 10_000,
        batch_size: int = 500,
        linger_s: float = 0.1,
    ) -> None:
        self.url = url
        self._queue: asyncio.Queue[LedgerEntry] = asyncio.Queue(max_queue)
        self._batch_size = batch_size
        # Wait this long for a batch to fill: one commit per batch, not per decision.
        self._linger_s = linger_s
        self._engine: Engine | None = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.written = 0

    async def start(self) -> None:
        await asyncio.to_thread(migrate, self.url)
        self._engine = make_engine(self.url)
        self._task = asyncio.create_task(self._run())

    def record(self, entry: LedgerEntry) -> None:
        try:
            self._queue.put_nowait(entry)
        except asyncio.QueueFull:
            self.dropped += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            until = loop.time() + self._linger_s
            while len(batch) < self._batch_size:
                if self._queue.empty():
                    left = until - loop.time()
                    if left <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), left))
                    except TimeoutError:
                        break
                else:
                    batch.append(self._queue.get_nowait())
            await self._write(batch)

    async def _write(self, batch: list[LedgerEntry]) -> None:
        try:
            await asyncio.to_thread(self._insert, batch)
            self.written += len(batch)
        except SQLAlchemyError:
            log.exception("ledger write of %d decisions failed; they are dropped", len(batch))
            self.dropped += len(batch)
            await asyncio.sleep(1.0)  # do not spin against a database that is down
        finally:
            for _ in batch:
                self._queue.task_done()

    def _insert(self, batch: list[LedgerEntry]) -> None:
        assert self._engine is not None
        with self._engine.begin() as conn:
            conn.execute(insert(_TABLE), [vars(entry) for entry in batch])

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything queued so far is written (or dropped)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout_s)

    async def stop(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        remaining: list[LedgerEntry] = []
        while not self._queue.empty():
            remaining.append(self._queue.get_nowait())
        if remaining:
            await self._write(remaining)
        if self._engine is not None:
            self._engine.dispose()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def read(self, limit: int = 1000) -> list[AdmissionRecord]:
        """The newest decisions (for tests and the admin view); blocking."""
        assert self._engine is not None
        with Session(self._engine) as session:
            query = select(AdmissionRecord).order_by(AdmissionRecord.id.desc()).limit(limit)  # type: ignore[union-attr]
            return list(session.exec(query))
