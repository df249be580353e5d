"""What bounds the batches a front door keeps: results downloaded a page at a time, a limit on a
tenant's batches not yet ended, and a retention after which ended batches, their results and
the files no batch names are deleted. A real front door in this process (so that the rows it
reads can be counted), on real NATS and a real SQLite database; no worker is needed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import Pool

from api.app import create_app
from api.batches import store
from api.batches.request import ParsedLine
from broker.admission.tenants import DEV_TENANT_ID
from broker.natsserver import EmbeddedNats
from broker.settings import ApiSettings
from tests.batches import Outcome, wait_for_batch, write_batch
from tests.calls import chat_body
from tests.polling import poll_until

PAGE = 3
END_BOUND_S = 20.0
"""For a cancelled batch to end, or an ended one and its files to be deleted after a 1 s
retention (the runner's tick is 0.5 s): generous for a loaded 2-core machine."""


@asynccontextmanager
async def front_door(
    nats_server: EmbeddedNats, tmp_path: Path, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        ApiSettings(
            nats_url=nats_server.url,
            database_url=f"sqlite:///{tmp_path / 'kvgate.db'}",
            batch_tick_s=0.1,
            **settings,
        )
    )
    failed: BaseException | None = None
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvgate") as c,
    ):
        try:
            yield c
        except BaseException as exc:
            # Raised through the lifespan, it would skip the front door's shutdown (only the
            # NATS drain is in a `finally`), and the drain then waits forever on the result
            # collector's open subscription: raised once the front door has stopped.
            failed = exc
    if failed is not None:
        raise failed


@contextmanager
def rows_per_query() -> Iterator[list[list[Any]]]:
    """Every statement run on a SQLite connection opened meanwhile, with the rows it handed
    back: ``[statement, cursor, rows]``."""
    queries: list[list[Any]] = []

    def executing(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        queries.append([statement, cursor, 0])

    def connected(dbapi_conn: Any, _: Any) -> None:
        def counted(cursor: Any, row: tuple[Any, ...]) -> tuple[Any, ...]:
            for query in reversed(queries):
                if query[1] is cursor:
                    query[2] += 1
                    break
            return row

        dbapi_conn.row_factory = counted

    event.listen(Engine, "before_cursor_execute", executing)
    event.listen(Pool, "connect", connected)
    try:
        yield queries
    finally:
        event.remove(Pool, "connect", connected)
        event.remove(Engine, "before_cursor_execute", executing)


def answer(n: int) -> dict[str, Any]:
    return {"status_code": 200, "body": {"id": f"chatcmpl-{n}", "choices": [{"text": "é"}]}}


LINES: list[Outcome] = [
    ("completed", answer(1), None),
    ("failed", store.line_error("invalid_parameter", "bad seed"), "invalid_parameter"),
    ("completed", answer(3), None),
    ("expired", None, "deadline_exceeded"),
    ("completed", answer(5), None),
    ("cancelled", store.line_error("cancelled", "cancelled"), "cancelled"),
    ("completed", answer(7), None),
]


def expected_results() -> bytes:
    """The results file as kvgate has always written it: one JSON object a line."""
    out = b""
    for n, (status, result, code) in enumerate(LINES, start=1):
        line: dict[str, Any] = {"custom_id": f"c{n}", "status": status}
        if result is not None:
            line.update(result)
        elif code is not None:
            line["error"] = {"code": code, "message": status}
        out += json.dumps(line).encode() + b"\n"
    return out


def expected_file(batch_id: str, completed: bool) -> bytes:
    """An output (or error) file in OpenAI's batch output format, as kvgate has always written
    it."""
    out = b""
    for n, (status, result, code) in enumerate(LINES, start=1):
        if (status == "completed") != completed:
            continue
        call_id = f"{batch_id}-{n}"
        line: dict[str, Any] = {"id": f"batch_req_{call_id}", "custom_id": f"c{n}"}
        if completed:
            assert result is not None
            response = {"status_code": result["status_code"], "request_id": call_id}
            line.update(response=response | {"body": result["body"]}, error=None)
        else:
            error = (result or {}).get("error") or {"code": code, "message": status}
            line.update(response=None, error=error)
        out += json.dumps(line).encode() + b"\n"
    return out


async def test_results_and_output_files_are_read_a_page_at_a_time(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with front_door(
        nats_server, tmp_path, batch_page_lines=PAGE, batch_runner=False
    ) as client:
        parsed = [ParsedLine(n, f"c{n}", f"s{n}", False, chat_body()) for n in range(1, 8)]
        db_url = f"sqlite:///{tmp_path / 'kvgate.db'}"
        batch_id = write_batch(db_url, DEV_TENANT_ID, parsed, status="completed", outcomes=LINES)
        with rows_per_query() as queries:
            results = await client.get(f"/v1/batches/{batch_id}/results")
            output = await client.get(f"/v1/files/file-{batch_id}-output/content")
            errors = await client.get(f"/v1/files/file-{batch_id}-errors/content")
            meta = await client.get(f"/v1/files/file-{batch_id}-output")
    assert results.status_code == 200 and results.headers["content-type"].startswith(
        "application/jsonl"
    )
    assert results.content == expected_results()
    assert output.status_code == errors.status_code == 200
    assert output.content == expected_file(batch_id, completed=True)
    assert errors.content == expected_file(batch_id, completed=False)
    assert meta.json()["bytes"] == len(output.content)
    # The reads of lines (not of their counts per status, which each route reads too).
    line_reads = [rows for sql, _, rows in queries if "batch_lines.custom_id" in sql]
    # Every line was read (7 for the results, 4 for each read of the output file, 3 errors)...
    assert sum(line_reads) == 7 + 4 + 3 + 4, line_reads
    # ...never more than a page at once.
    assert max(line_reads) <= PAGE, line_reads


async def test_a_tenant_may_have_so_many_batches_open_at_once(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    lines = [{"custom_id": "a", "body": chat_body()}]
    async with front_door(nats_server, tmp_path, batch_max_open=2) as client:
        # No worker is up: the batches stay in progress.
        keyed = await client.post(
            "/v1/batches", json={"requests": lines}, headers={"Idempotency-Key": "nightly"}
        )
        second = await client.post("/v1/batches", json={"requests": lines})
        third = await client.post("/v1/batches", json={"requests": lines})
        jsonl = await client.post(
            "/v1/batches",
            content=json.dumps(lines[0]),
            headers={"content-type": "application/jsonl"},
        )
        again = await client.post(
            "/v1/batches", json={"requests": lines}, headers={"Idempotency-Key": "nightly"}
        )
        assert (keyed.status_code, second.status_code) == (201, 201)
        for refused in (third, jsonl):
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "60"
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("too_many_open_batches", "rate_limit_error")
            assert "at most 2" in error["message"]
        # A retry of a batch already made is that batch, not a refusal.
        assert (again.status_code, again.json()["id"]) == (200, keyed.json()["id"])

        await client.post(f"/v1/batches/{second.json()['id']}/cancel")
        await wait_for_batch(
            client, second.json()["id"], lambda b: b["status"] == "cancelled", timeout_s=END_BOUND_S
        )
        after = await client.post("/v1/batches", json={"requests": lines})
    assert after.status_code == 201, after.text


async def test_ended_batches_and_unused_files_are_deleted_after_the_retention(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    def upload(name: str) -> dict[str, Any]:
        line = json.dumps({"custom_id": name, "body": chat_body()})
        return {"file": (f"{name}.jsonl", line.encode()), "purpose": (None, "batch")}

    async with front_door(nats_server, tmp_path, batch_retention_s=1.0) as client:
        kept_file = (await client.post("/v1/files", files=upload("kept"))).json()["id"]
        ended_file = (await client.post("/v1/files", files=upload("ended"))).json()["id"]
        unused_file = (await client.post("/v1/files", files=upload("unused"))).json()["id"]
        body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
        kept = await client.post("/v1/batches", json={**body, "input_file_id": kept_file})
        ended = await client.post("/v1/batches", json={**body, "input_file_id": ended_file})
        kept_id, ended_id = kept.json()["id"], ended.json()["id"]
        await client.post(f"/v1/batches/{ended_id}/cancel")

        gone = await poll_until(
            lambda: client.get(f"/v1/batches/{ended_id}"),
            lambda resp: resp.status_code == 404,
            timeout_s=END_BOUND_S,
        )
        assert gone.json()["error"]["code"] == "batch_not_found"
        for path in (
            f"/v1/batches/{ended_id}/results",
            f"/v1/files/{ended_file}",
            f"/v1/files/{ended_file}/content",
            f"/v1/files/file-{ended_id}-errors/content",
        ):
            assert (await client.get(path)).status_code == 404, path
        await poll_until(
            lambda: client.get(f"/v1/files/{unused_file}"),
            lambda resp: resp.status_code == 404,
            timeout_s=END_BOUND_S,
        )
        # A batch not yet ended, and the file it was made from, are kept however old.
        still = await client.get(f"/v1/batches/{kept_id}")
        assert (still.status_code, still.json()["status"]) == (200, "in_progress")
        assert (await client.get(f"/v1/files/{kept_file}/content")).status_code == 200
