"""A batch submission turned into lines: what a body may cost the front door before its lines
are known to be within the limits, and lines that would be refused later refused at once."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from api.batches.request import parse_file_submission
from broker.errors import InvalidRequest
from broker.natsserver import EmbeddedNats
from broker.settings import ApiSettings
from schemas.vocab import ErrorCode
from tests.calls import chat_body
from tests.procs import start_api
from tests.tenants import tenant, write_tenants_file

MODEL = "kvgate-sim"
LINES = 100_000
KEY = "acme-key"

STALL_SHARE = 1 / 3
"""The longest health check, as a share of the whole submission, while the front door parses
a big batch. Parsed on the event loop, a health check sent during the parse waits for all of
it (1.7 s of a submission of a few seconds here); parsed in a thread, it waits a few of the
GIL's 5 ms turns. A share, not seconds, so a slower or busier machine moves both alike."""


def test_lines_past_the_limit_are_refused_before_any_is_parsed() -> None:
    # A parsed line costs some hundreds of bytes however short its text: 256 KiB of "1\n"
    # parsed first would cost tens of MiB before the limit refused it.
    content = b"1\n" * (1 << 17)
    settings = ApiSettings(batch_max_lines=1000)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="at most 1000 lines") as refused:
            parse_file_submission(content, {}, settings, [MODEL])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.code == ErrorCode.INVALID_REQUEST  # 400
    assert peak < 4 * len(content), f"{peak} bytes held to refuse {len(content)} bytes"


def test_blank_lines_are_skipped_and_not_counted() -> None:
    line = json.dumps({"custom_id": "a", "body": chat_body(model=MODEL)})
    content = f"\n  \n{line}\r\n\t\n".encode() + b"\n" * (1 << 16)
    submission = parse_file_submission(content, {}, ApiSettings(batch_max_lines=1), [MODEL])
    assert [(x.line, x.custom_id, x.error) for x in submission.lines] == [(1, "a", None)]
    with pytest.raises(InvalidRequest, match="no lines"):
        parse_file_submission(b"\n \n", {}, ApiSettings(), [MODEL])


async def test_the_front_door_answers_while_it_parses_a_big_batch(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    tenants = write_tenants_file(tmp_path, tenant("acme", KEY))
    proc, base = start_api(
        nats_server.url,
        tmp_path,
        KVGATE_TENANTS_FILE=str(tenants),
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_BATCH_RUNNER="false",
        KVGATE_BATCH_MAX_LINES=str(LINES),
    )
    # As many lines as this front door takes: over a second of parsing.
    body = chat_body(model=MODEL)
    jsonl = "\n".join(json.dumps({"custom_id": f"c{i}", "body": body}) for i in range(LINES))
    try:
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        ) as client:
            submit = asyncio.create_task(
                client.post(
                    "/v1/batches",
                    content=jsonl.encode(),
                    headers={"content-type": "application/jsonl"},
                )
            )
            stalls: list[float] = []
            began = time.monotonic()
            while not submit.done():
                started = time.monotonic()
                assert (await client.get("/healthz")).status_code == 200
                stalls.append(time.monotonic() - started)
            resp = await submit
            submit_s = time.monotonic() - began
    finally:
        proc.stop()
    assert resp.status_code == 201, resp.text
    assert resp.json()["request_counts"]["total"] == LINES
    assert len(stalls) > 1 and max(stalls) < STALL_SHARE * submit_s, (stalls, submit_s)
