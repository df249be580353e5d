"""Following a batch through a front door's HTTP API: waiting on its status, reading its
results; and a batch written straight to the database."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx

from api.batches import store
from api.batches.request import ParsedLine
from api.routes.batches import line_rows
from broker.db import make_engine, utcnow
from tests.polling import poll_until

FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
"""The statuses a batch never leaves."""


def has_ended(batch: dict[str, Any]) -> bool:
    return batch["status"] in FINAL_STATUSES


async def wait_for_batch(
    client: httpx.AsyncClient,
    batch_id: str,
    until: Callable[[dict[str, Any]], bool] = has_ended,
    *,
    timeout_s: float,
    interval_s: float = 0.2,
) -> dict[str, Any]:
    """Read ``GET /v1/batches/{batch_id}`` until ``until`` holds for the batch (by default, until
    it has ended); that batch, or ``TimeoutError``."""

    async def read() -> dict[str, Any]:
        batch: dict[str, Any] = (await client.get(f"/v1/batches/{batch_id}")).json()
        return batch

    return await poll_until(read, until, timeout_s=timeout_s, interval_s=interval_s)


async def batch_results(client: httpx.AsyncClient, batch_id: str) -> list[dict[str, Any]]:
    """The batch's results file, one dict a line."""
    resp = await client.get(f"/v1/batches/{batch_id}/results")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/jsonl")
    return [json.loads(x) for x in resp.text.split("\n") if x]


Outcome = tuple[str, dict[str, Any] | None, str | None]
"""A line's status, result and error code."""


def write_batch(
    db_url: str,
    tenant: str,
    lines: list[ParsedLine],
    *,
    status: str = "in_progress",
    outcomes: list[Outcome] | None = None,
) -> str:
    """A batch written straight to the database, as a front door of an earlier version would
    have: its lines are not checked. With ``outcomes``, its lines have them (and the batch
    ended now if ``status`` is an end). Its id."""
    now = utcnow()
    batch_id = f"batch_{uuid.uuid4().hex}"
    batch = {
        "id": batch_id,
        "tenant": tenant,
        "tier": "besteffort",
        "status": status,
        "completion_window_s": 3600,
        "created_at": now,
        "expires_at": now + timedelta(hours=1),
        "finished_at": now if status in FINAL_STATUSES else None,
        "cancel_requested": False,
        "total": len(lines),
        "idempotency_key": None,
        "runner": None,
        "runner_seen_at": None,
        "metadata": {},
        "input_file_id": None,
    }
    rows = line_rows(batch_id, lines, now)
    for row, (line_status, result, code) in zip(rows, outcomes or [], strict=False):
        row.update(status=line_status, result=result, error_code=code, finished_at=now)
    engine = make_engine(db_url)
    try:
        store.create_batch(engine, batch, rows)
    finally:
        engine.dispose()
    return batch_id
