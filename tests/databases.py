"""A PostgreSQL database of its own for a test, on the server CI and this machine run
(127.0.0.1:5432, trust auth), dropped afterwards."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    name = f"kvgate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
