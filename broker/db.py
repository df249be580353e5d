"""The database the front doors share: its engine, its schema and the clock its rows are
stamped with.

One database holds the admission ledger (``broker.ledger``), the batches and their lines
(``api.batches.store``) and uploaded files (``api.batches.files``): an SQLite file by default,
PostgreSQL with ``KVGATE_DATABASE_URL``. The schema is owned by the Alembic migrations in
``broker/migrations`` (hand-written, one per change); every front door upgrades to head at
start-up, and replicas starting together on PostgreSQL take turns (an advisory lock).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import NullPool
from sqlmodel import SQLModel

MIGRATIONS = Path(__file__).with_name("migrations")
_MIGRATION_LOCK = 0x6B7667617465  # "kvgate"

metadata = SQLModel.metadata
"""Every table kvgate declares (SQLModel registers each on import): the migrations' target."""


def utcnow() -> datetime:
    """The time rows are stamped with: aware, in UTC."""
    return datetime.now(UTC)


def engine_url(url: str) -> str:
    """Accept plain ``postgresql://`` URLs, using the psycopg 3 driver kvgate installs."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    url = engine_url(url)
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    if parsed.database:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, pool_pre_ping=True)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(conn: Any, _: Any) -> None:
        # WAL: readers (an operator's query) never block the writer; NORMAL: one fsync per
        # checkpoint rather than per commit, still crash-safe for the database file.
        cursor = conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def migrate(url: str) -> None:
    """Upgrade the database at ``url`` to the newest schema (idempotent)."""
    url = engine_url(url)
    parsed = make_url(url)
    if parsed.drivername.startswith("sqlite") and parsed.database:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Replicas starting together: one migrates, the others wait, then find the
                # schema at head. The lock ends with the transaction.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
    finally:
        engine.dispose()
