"""Batches in the database: the batch, its lines, their results (SQLModel tables owned by the
Alembic migrations, in the same database as the ledger).

Invariants a reader must not break:
- A line's ``call_id`` is fixed when the batch is created and reused by every publish of that
  line, so JetStream deduplicates a re-publish after a front door restarts, and a result from
  any attempt finds its line.
- A line gets a terminal status exactly once: every update to a terminal status is
  conditional on the line not being terminal already (the first result wins; a duplicate
  result, or one arriving after a cancel, changes nothing).

Every function here is blocking; the front door calls them from a worker thread.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Integer, delete, func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Field, SQLModel

from broker.errors import TooManyOpenBatches


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class LineStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


TERMINAL_LINES = frozenset(
    {LineStatus.COMPLETED, LineStatus.FAILED, LineStatus.EXPIRED, LineStatus.CANCELLED}
)
OPEN_LINES = (LineStatus.PENDING.value, LineStatus.RUNNING.value)
UNANSWERED_LINES = frozenset(
    {LineStatus.FAILED.value, LineStatus.EXPIRED.value, LineStatus.CANCELLED.value}
)
"""Lines that ended without an answer: what a batch's error file holds."""
ENDED_BATCHES = frozenset(
    {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


_RESULT_FILES = {"-output": frozenset({LineStatus.COMPLETED.value}), "-errors": UNANSWERED_LINES}


def line_error(code: str, message: str) -> dict[str, Any]:
    """A failed line's ``error``, as its result file carries it."""
    return {"error": {"code": code, "message": message}}


def output_file_id(batch_id: str) -> str:
    """The id of a batch's output file (OpenAI's flow), built from its lines when read."""
    return f"file-{batch_id}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-errors"


def result_file(file_id: str) -> tuple[str, frozenset[str]] | None:
    """The batch an output or error file id names, and the line statuses the file holds."""
    if file_id.startswith("file-batch_"):
        for suffix, statuses in _RESULT_FILES.items():
            if file_id.endswith(suffix):
                return file_id.removeprefix("file-").removesuffix(suffix), statuses
    return None


class Batch(SQLModel, table=True):
    __tablename__ = "batches"

    id: str = Field(primary_key=True, max_length=64)
    tenant: str = Field(max_length=64)
    tier: str = Field(max_length=16)
    status: str = Field(max_length=16)
    completion_window_s: int
    created_at: datetime
    expires_at: datetime
    finished_at: datetime | None = None
    cancel_requested: bool = False
    total: int
    idempotency_key: str | None = Field(default=None, max_length=255)
    runner: str | None = Field(default=None, max_length=64)
    runner_seen_at: datetime | None = None
    metadata_: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column("metadata", JSON, nullable=False)
    )
    input_file_id: str | None = Field(default=None, max_length=64)
    """The uploaded file the batch was made from (OpenAI's flow), if any."""


class BatchLine(SQLModel, table=True):
    __tablename__ = "batch_lines"

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    )
    batch_id: str = Field(max_length=64)
    line_no: int
    custom_id: str = Field(max_length=255)
    session_key: str = Field(max_length=255)
    parallel: bool = False
    body: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    status: str = Field(default=LineStatus.PENDING.value, max_length=16)
    call_id: str = Field(max_length=64)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    error_code: str | None = Field(default=None, max_length=32)


BATCHES = Batch.__table__  # type: ignore[attr-defined]
LINES = BatchLine.__table__  # type: ignore[attr-defined]
OPEN_BATCHES = tuple(s.value for s in BatchStatus if s not in ENDED_BATCHES)


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    tenant: str
    tier: str
    status: str
    completion_window_s: int
    created_at: datetime
    expires_at: datetime
    finished_at: datetime | None
    cancel_requested: bool
    total: int
    idempotency_key: str | None
    metadata: dict[str, Any]
    input_file_id: str | None = None


@dataclass(frozen=True, slots=True)
class LineState:
    """What the runner needs of a line to decide whether it may start: no body, no result."""

    id: int
    line_no: int
    session_key: str
    parallel: bool
    status: str
    call_id: str


_STATE_COLUMNS = (
    LINES.c.id,
    LINES.c.line_no,
    LINES.c.session_key,
    LINES.c.parallel,
    LINES.c.status,
    LINES.c.call_id,
)


@dataclass(frozen=True, slots=True)
class LineResult:
    """What a batch's results and output files show of a line."""

    line_no: int
    custom_id: str
    status: str
    call_id: str
    result: dict[str, Any] | None
    error_code: str | None


_RESULT_COLUMNS = (
    LINES.c.line_no,
    LINES.c.custom_id,
    LINES.c.status,
    LINES.c.call_id,
    LINES.c.result,
    LINES.c.error_code,
)


@dataclass(frozen=True, slots=True)
class BatchView:
    batch: BatchRow
    counts: dict[str, int]


def _batch(row: Any) -> BatchRow:
    m = row._mapping
    return BatchRow(
        id=m["id"],
        tenant=m["tenant"],
        tier=m["tier"],
        status=m["status"],
        completion_window_s=m["completion_window_s"],
        created_at=_utc(m["created_at"]),
        expires_at=_utc(m["expires_at"]),
        finished_at=None if m["finished_at"] is None else _utc(m["finished_at"]),
        cancel_requested=bool(m["cancel_requested"]),
        total=m["total"],
        idempotency_key=m["idempotency_key"],
        metadata=m["metadata"] or {},
        input_file_id=m["input_file_id"],
    )


def _utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything here is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def line_call_id(batch_id: str, line_no: int) -> str:
    return f"{batch_id}-{line_no}"


def create_batch(
    engine: Engine,
    batch: dict[str, Any],
    lines: list[dict[str, Any]],
    *,
    max_open: int | None = None,
) -> tuple[BatchRow, bool]:
    """Insert the batch and its lines in one transaction. With an idempotency key the tenant
    already used, returns that batch instead (``created`` False). With ``max_open``, raises
    ``TooManyOpenBatches`` rather than give the tenant more batches not yet ended: counted in
    the inserting transaction, after the insert, so that front doors creating batches at once
    cannot all pass the count (SQLite lets one writer in at a time; on PostgreSQL a lock per
    tenant does the same)."""
    key = batch.get("idempotency_key")
    if key is not None:
        existing = _by_idempotency_key(engine, batch["tenant"], key)
        if existing is not None:
            return existing, False
    try:
        with engine.begin() as conn:
            if max_open is not None and conn.dialect.name == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(batch["tenant"]))))
            conn.execute(insert(BATCHES), [batch])
            if max_open is not None:
                _check_open(conn, batch["tenant"], max_open, including_new=True)
            conn.execute(insert(LINES), lines)
            row = conn.execute(select(BATCHES).where(BATCHES.c.id == batch["id"])).one()
            return _batch(row), True
    except IntegrityError:
        if key is None:
            raise
        existing = _by_idempotency_key(engine, batch["tenant"], key)
        assert existing is not None
        return existing, False


def check_open_batches(engine: Engine, tenant: str, max_open: int) -> None:
    """Raise ``TooManyOpenBatches`` if the tenant has ``max_open`` batches not yet ended: a
    cheap refusal before a submission is parsed (``create_batch`` checks again, exactly)."""
    with engine.connect() as conn:
        _check_open(conn, tenant, max_open, including_new=False)


def _check_open(conn: Connection, tenant: str, max_open: int, *, including_new: bool) -> None:
    query = select(func.count()).where(
        BATCHES.c.tenant == tenant, BATCHES.c.status.in_(OPEN_BATCHES)
    )
    count = int(conn.execute(query).scalar_one()) - (1 if including_new else 0)
    if count >= max_open:
        raise TooManyOpenBatches(
            f"{count} batches of this tenant have not ended yet, and at most {max_open} may be "
            "open at once; wait for one to end, or cancel one"
        )


def delete_ended_before(engine: Engine, cutoff: datetime, limit: int) -> int:
    """Delete up to ``limit`` batches that ended before ``cutoff``, with their lines (and so
    their results, output and error files); returns how many. A few batches a transaction:
    each may have tens of thousands of lines."""
    with engine.begin() as conn:
        ids = list(
            conn.execute(
                select(BATCHES.c.id)
                .where(
                    BATCHES.c.status.in_([s.value for s in ENDED_BATCHES]),
                    BATCHES.c.finished_at < cutoff,
                )
                .limit(limit)
            ).scalars()
        )
        if ids:
            conn.execute(delete(LINES).where(LINES.c.batch_id.in_(ids)))
            conn.execute(delete(BATCHES).where(BATCHES.c.id.in_(ids)))
    return len(ids)


def _by_idempotency_key(engine: Engine, tenant: str, key: str) -> BatchRow | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(BATCHES).where(BATCHES.c.tenant == tenant, BATCHES.c.idempotency_key == key)
        ).first()
    return None if row is None else _batch(row)


def get_batch(engine: Engine, tenant: str, batch_id: str) -> BatchView | None:
    with engine.connect() as conn:
        row = conn.execute(select(BATCHES).where(BATCHES.c.id == batch_id)).first()
        if row is None or row._mapping["tenant"] != tenant:
            return None
        return BatchView(_batch(row), _counts(conn, [batch_id])[batch_id])


def list_batches(
    engine: Engine, tenant: str, *, after: str | None, limit: int
) -> tuple[list[BatchView], bool]:
    """The tenant's batches, newest first; ``after`` is the last id of the previous page."""
    with engine.connect() as conn:
        query = select(BATCHES).where(BATCHES.c.tenant == tenant)
        if after is not None:
            anchor = conn.execute(
                select(BATCHES.c.created_at).where(
                    BATCHES.c.id == after, BATCHES.c.tenant == tenant
                )
            ).first()
            if anchor is not None:
                at = anchor[0]
                query = query.where(
                    (BATCHES.c.created_at < at)
                    | ((BATCHES.c.created_at == at) & (BATCHES.c.id < after))
                )
        query = query.order_by(BATCHES.c.created_at.desc(), BATCHES.c.id.desc()).limit(limit + 1)
        rows = [_batch(r) for r in conn.execute(query)]
        counts = _counts(conn, [b.id for b in rows[:limit]])
        return [BatchView(b, counts[b.id]) for b in rows[:limit]], len(rows) > limit


def _counts(conn: Connection, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {i: {s.value: 0 for s in LineStatus} for i in batch_ids}
    if not batch_ids:
        return out
    query = (
        select(LINES.c.batch_id, LINES.c.status, func.count())
        .where(LINES.c.batch_id.in_(batch_ids))
        .group_by(LINES.c.batch_id, LINES.c.status)
    )
    for batch_id, status, count in conn.execute(query):
        out[batch_id][status] = count
    return out


def line_states(engine: Engine, batch_id: str) -> list[LineState]:
    """Every line of the batch, in line order, without bodies or results: read once when a
    runner takes the batch over."""
    query = select(*_STATE_COLUMNS).where(LINES.c.batch_id == batch_id).order_by(LINES.c.line_no)
    with engine.connect() as conn:
        return [
            LineState(r.id, r.line_no, r.session_key, bool(r.parallel), r.status, r.call_id)
            for r in conn.execute(query)
        ]


def running_line_ids(engine: Engine, batch_id: str) -> set[int]:
    """The batch's lines that are running now (an index range: as many rows as lines run)."""
    query = select(LINES.c.id).where(
        LINES.c.batch_id == batch_id, LINES.c.status == LineStatus.RUNNING.value
    )
    with engine.connect() as conn:
        return set(conn.execute(query).scalars())


def line_bodies(engine: Engine, line_ids: list[int]) -> dict[int, dict[str, Any]]:
    """The request bodies of the lines ``line_ids``, by id."""
    out: dict[int, dict[str, Any]] = {}
    with engine.connect() as conn:
        # In chunks: a statement may carry only so many parameters (SQLite: 32,766).
        for start in range(0, len(line_ids), _ID_CHUNK):
            chunk = line_ids[start : start + _ID_CHUNK]
            query = select(LINES.c.id, LINES.c.body).where(LINES.c.id.in_(chunk))
            out.update((row.id, row.body) for row in conn.execute(query))
    return out


_ID_CHUNK = 1000


def line_counts(engine: Engine, batch_id: str) -> dict[str, int]:
    """How many lines of the batch have each status."""
    with engine.connect() as conn:
        return _counts(conn, [batch_id])[batch_id]


def result_page(
    engine: Engine,
    batch_id: str,
    statuses: Iterable[str] | None,
    after_line_no: int,
    limit: int,
) -> list[LineResult]:
    """Up to ``limit`` lines of the batch after line ``after_line_no``, in line order (of
    ``statuses`` only, if given): one page of a results download, read by the index on
    ``(batch_id, line_no)`` whatever the page."""
    query = select(*_RESULT_COLUMNS).where(
        LINES.c.batch_id == batch_id, LINES.c.line_no > after_line_no
    )
    if statuses is not None:
        query = query.where(LINES.c.status.in_(list(statuses)))
    query = query.order_by(LINES.c.line_no).limit(limit)
    with engine.connect() as conn:
        return [
            LineResult(r.line_no, r.custom_id, r.status, r.call_id, r.result, r.error_code)
            for r in conn.execute(query)
        ]


def claim_batches(engine: Engine, runner: str, now: datetime, stale_s: float) -> list[BatchRow]:
    """Take over every unfinished batch nobody runs (or whose runner went silent), renew the
    ones this runner holds, and return them."""
    stale = now - timedelta(seconds=stale_s)
    open_statuses = (BatchStatus.IN_PROGRESS.value, BatchStatus.CANCELLING.value)
    with engine.begin() as conn:
        conn.execute(
            update(BATCHES)
            .where(
                BATCHES.c.status.in_(open_statuses),
                BATCHES.c.runner.is_(None)
                | (BATCHES.c.runner == runner)
                | (BATCHES.c.runner_seen_at < stale),
            )
            .values(runner=runner, runner_seen_at=now)
        )
        rows = conn.execute(
            select(BATCHES).where(BATCHES.c.runner == runner, BATCHES.c.status.in_(open_statuses))
        )
        return [_batch(r) for r in rows]


def mark_started(engine: Engine, line_ids: Iterable[int], now: datetime) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(LINES)
            .where(LINES.c.id.in_(list(line_ids)), LINES.c.status == LineStatus.PENDING.value)
            .values(status=LineStatus.RUNNING.value, started_at=now)
        )


def finish_lines(
    engine: Engine,
    outcomes: Iterable[tuple[str, LineStatus, dict[str, Any] | None, str | None]],
    now: datetime,
) -> int:
    """Give lines (by call id) their terminal status and result, unless they already have
    one. Returns how many lines changed."""
    changed = 0
    with engine.begin() as conn:
        for call_id, status, result, error_code in outcomes:
            res = conn.execute(
                update(LINES)
                .where(LINES.c.call_id == call_id, LINES.c.status.in_(OPEN_LINES))
                .values(status=status.value, result=result, error_code=error_code, finished_at=now)
            )
            changed += res.rowcount
    return changed


def end_open_lines(
    engine: Engine,
    batch_id: str,
    status: LineStatus,
    code: str,
    now: datetime,
    *,
    only_pending: bool,
) -> int:
    statuses = (LineStatus.PENDING.value,) if only_pending else OPEN_LINES
    with engine.begin() as conn:
        res = conn.execute(
            update(LINES)
            .where(LINES.c.batch_id == batch_id, LINES.c.status.in_(statuses))
            .values(status=status.value, error_code=code, result=None, finished_at=now)
        )
        return int(res.rowcount)


def set_status(
    engine: Engine, batch_id: str, status: BatchStatus, now: datetime | None = None
) -> None:
    values: dict[str, Any] = {"status": status.value}
    if now is not None:
        values["finished_at"] = now
    with engine.begin() as conn:
        conn.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values(**values))


def request_cancel(engine: Engine, tenant: str, batch_id: str) -> BatchView | None:
    with engine.begin() as conn:
        conn.execute(
            update(BATCHES)
            .where(
                BATCHES.c.id == batch_id,
                BATCHES.c.tenant == tenant,
                BATCHES.c.status.in_((BatchStatus.IN_PROGRESS.value, BatchStatus.VALIDATING.value)),
            )
            .values(cancel_requested=True, status=BatchStatus.CANCELLING.value)
        )
    return get_batch(engine, tenant, batch_id)
