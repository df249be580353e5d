"""A batch's results as they are downloaded: the results file (``/v1/batches/{id}/results``)
and OpenAI's output and error files (``/v1/files/file-<batch id>-output/content``), read from
the lines a page at a time (``batch_page_lines``), so that a download holds one page in
memory, however many lines the batch has. Each page is read in a worker thread.

A line that changes while the batch runs is shown as it is when its page is read; each line is
shown once (pages follow the line number).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from sqlalchemy.engine import Engine

from api.batches import store
from api.batches.store import LineResult, LineStatus


async def results_file(engine: Engine, batch_id: str, page_lines: int) -> AsyncIterator[bytes]:
    """Every line of the batch, in line order: ``custom_id``, ``status``, and its answer or
    error. One chunk a page."""
    async for chunk in _pages(engine, batch_id, None, page_lines, _result_line):
        yield chunk


async def output_file(
    engine: Engine, batch_id: str, statuses: Collection[str], page_lines: int
) -> AsyncIterator[bytes]:
    """The lines of the batch with one of ``statuses``, in OpenAI's batch output format. One
    chunk a page."""
    async for chunk in _pages(engine, batch_id, statuses, page_lines, _output_line):
        yield chunk


async def _pages(
    engine: Engine,
    batch_id: str,
    statuses: Collection[str] | None,
    page_lines: int,
    shape: Callable[[LineResult], dict[str, Any]],
) -> AsyncIterator[bytes]:
    after = 0  # line numbers start at 1
    while True:
        page = await asyncio.to_thread(
            store.result_page, engine, batch_id, statuses, after, page_lines
        )
        if page:
            yield b"".join(json.dumps(shape(line)).encode() + b"\n" for line in page)
        if len(page) < page_lines:
            return
        after = page[-1].line_no


def _result_line(line: LineResult) -> dict[str, Any]:
    out: dict[str, Any] = {"custom_id": line.custom_id, "status": line.status}
    if line.result is not None:
        out.update(line.result)
    elif line.error_code is not None:
        out["error"] = {"code": line.error_code, "message": line.status}
    return out


def _output_line(line: LineResult) -> dict[str, Any]:
    """One line of a batch's output or error file, in OpenAI's batch output format."""
    out: dict[str, Any] = {"id": f"batch_req_{line.call_id}", "custom_id": line.custom_id}
    result = line.result or {}
    if line.status == LineStatus.COMPLETED.value:
        response = {"status_code": result.get("status_code", 200), "request_id": line.call_id}
        out.update(response=response | {"body": result.get("body")}, error=None)
    else:
        error = result.get("error") or {"code": line.error_code, "message": line.status}
        out.update(response=None, error=error)
    return out
