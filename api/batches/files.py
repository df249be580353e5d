"""Files in the database: what a caller uploads with OpenAI's Files API (batch input), in the
same database as the batches, so that a file uploaded through one front door can be used
through any other.

A batch's output and error files are not stored: they are read from its lines when asked for
(``api/routes/files.py``), so they always agree with the batch's results.

Every function here is blocking; the front door calls them from a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Column, Integer, LargeBinary, delete, exists, insert, select
from sqlalchemy.engine import Engine
from sqlmodel import Field, SQLModel

from api.batches.store import BATCHES


class StoredFile(SQLModel, table=True):
    __tablename__ = "files"

    id: str = Field(primary_key=True, max_length=64)
    tenant: str = Field(max_length=64)
    purpose: str = Field(max_length=32)
    filename: str = Field(max_length=255)
    size: int = Field(sa_column=Column("bytes", Integer, nullable=False))
    created_at: datetime
    content: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


FILES = StoredFile.__table__  # type: ignore[attr-defined]
_META = [c for c in FILES.c if c.name != "content"]


@dataclass(frozen=True, slots=True)
class FileMeta:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime


def _meta(row: object) -> FileMeta:
    m = row._mapping  # type: ignore[attr-defined]
    created = m["created_at"]
    if created.tzinfo is None:  # SQLite keeps no zone; every time written here is UTC
        created = created.replace(tzinfo=UTC)
    return FileMeta(m["id"], m["purpose"], m["filename"], m["bytes"], created)


def create_file(engine: Engine, meta: FileMeta, tenant: str, content: bytes) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(FILES),
            [{**_fields(meta), "tenant": tenant, "content": content}],
        )


def _fields(meta: FileMeta) -> dict[str, object]:
    return {
        "id": meta.id,
        "purpose": meta.purpose,
        "filename": meta.filename,
        "bytes": meta.bytes,
        "created_at": meta.created_at,
    }


def read_file(engine: Engine, tenant: str, file_id: str) -> tuple[FileMeta, bytes] | None:
    """The tenant's file and its content, in one query."""
    with engine.connect() as conn:
        query = select(*_META, FILES.c.content).where(
            FILES.c.id == file_id, FILES.c.tenant == tenant
        )
        row = conn.execute(query).first()
    return None if row is None else (_meta(row), bytes(row._mapping["content"]))


def list_files(engine: Engine, tenant: str, purpose: str | None, limit: int) -> list[FileMeta]:
    """The tenant's files, newest first."""
    query = select(*_META).where(FILES.c.tenant == tenant)
    if purpose is not None:
        query = query.where(FILES.c.purpose == purpose)
    query = query.order_by(FILES.c.created_at.desc(), FILES.c.id.desc()).limit(limit)
    with engine.connect() as conn:
        return [_meta(row) for row in conn.execute(query)]


def delete_file(engine: Engine, tenant: str, file_id: str) -> bool:
    with engine.begin() as conn:
        done = conn.execute(delete(FILES).where(FILES.c.id == file_id, FILES.c.tenant == tenant))
    return bool(done.rowcount)


def delete_unused_before(engine: Engine, cutoff: datetime, limit: int) -> int:
    """Delete up to ``limit`` files uploaded before ``cutoff`` that no batch names as its input
    (a batch is deleted with its results, after the retention: see ``store``); returns how
    many."""
    used = exists().where(BATCHES.c.input_file_id == FILES.c.id)
    with engine.begin() as conn:
        ids = list(
            conn.execute(
                select(FILES.c.id).where(FILES.c.created_at < cutoff, ~used).limit(limit)
            ).scalars()
        )
        if ids:
            # The condition again: a batch made from one of them since is not left dangling.
            done = conn.execute(delete(FILES).where(FILES.c.id.in_(ids), ~used))
            return int(done.rowcount)
    return 0
