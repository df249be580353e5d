"""The decision ledger on SQLite and on the real PostgreSQL (a database created per test and
dropped afterwards): migrations, off-path batched writes, and counted drops."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from broker.db import engine_url, migrate, utcnow
from broker.ledger import Ledger, LedgerEntry
from tests.databases import postgres_database


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ledger.db"
        return
    with postgres_database() as url:
        yield url


def entry(i: int, decision: str = "admit", reason: str = "admitted") -> LedgerEntry:
    return LedgerEntry(
        decided_at=utcnow(),
        replica="r1",
        tenant="acme",
        tier="standard",
        scope="session",
        session_id=f"sess_{i}",
        decision=decision,
        reason=reason,
        retry_after_s=None if decision == "admit" else 3,
        latency_us=120 + i,
        signals={"capacity_tokens": 2048, "reserved_tokens": i * 10, "pressure": "normal"},
    )


def test_migrations_create_the_schema_and_are_idempotent(database_url: str) -> None:
    migrate(database_url)
    migrate(database_url)  # a second replica starting
    engine = create_engine(engine_url(database_url))
    try:
        inspector = inspect(engine)
        columns = {c["name"] for c in inspector.get_columns("admission_decisions")}
        tables = set(inspector.get_table_names())
        with engine.connect() as conn:
            version = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    finally:
        engine.dispose()
    assert {"tenant", "tier", "decision", "reason", "signals", "latency_us"} <= columns
    assert version == "0004"  # the head revision
    assert {"admission_decisions", "batches", "batch_lines"} <= tables


async def test_decisions_are_written_in_the_background_with_their_signals(
    database_url: str,
) -> None:
    ledger = Ledger(database_url)
    await ledger.start()
    try:
        for i in range(250):
            ledger.record(entry(i) if i % 5 else entry(i, "defer", "fleet_saturated"))
        await ledger.flush()
        rows = await asyncio.to_thread(ledger.read, 1000)
    finally:
        await ledger.stop()
    assert len(rows) == 250 and ledger.written == 250 and ledger.dropped == 0
    deferred = [r for r in rows if r.decision == "defer"]
    assert len(deferred) == 50
    assert all(r.reason == "fleet_saturated" and r.retry_after_s == 3 for r in deferred)
    newest = rows[0]
    assert newest.signals == {
        "capacity_tokens": 2048,
        "reserved_tokens": 2490,
        "pressure": "normal",
    }
    assert newest.decided_at is not None


async def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db", max_queue=10)
    # Not started: nothing drains the queue, as when the database is stalled.
    for i in range(25):
        ledger.record(entry(i))
    assert (ledger.queued, ledger.dropped) == (10, 15)


async def test_an_unreachable_database_counts_drops_and_keeps_going(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    await ledger.start()
    try:
        # The database goes away under the writer: its file's directory is replaced by a file.
        (tmp_path / "ledger.db").unlink()
        (tmp_path / "ledger.db").mkdir()
        for i in range(3):
            ledger.record(entry(i))
        await ledger.flush()
    finally:
        await ledger.stop()
    assert ledger.dropped == 3 and ledger.written == 0
