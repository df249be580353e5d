"""Following a batch through a front door's HTTP API: waiting on its status, reading its
results."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

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
