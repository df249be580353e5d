"""The official ``openai`` client's batch flow, unchanged, through two front doors that share
one database: upload a JSONL file through one, create and follow the batch through the other,
read the output and error files back. Real NATS, real front doors (subprocesses), an in-process
worker on the simulated engine (what is under test is the API, not the engine)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from broker.natsserver import EmbeddedNats
from tests.batches import FINAL_STATUSES
from tests.calls import chat_body
from tests.polling import poll_until
from tests.procs import start_api
from tests.simworker import sim_worker
from tests.tenants import tenant, write_tenants_file
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
ACME, OTHER = "acme-key", "other-key"


@dataclass
class Doors:
    first: str
    second: str

    def client(self, base: str, key: str = ACME) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


@pytest.fixture
async def doors(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Doors]:
    tenants = write_tenants_file(tmp_path, tenant("acme", ACME), tenant("other", OTHER))
    env = {
        "KVGATE_TENANTS_FILE": str(tenants),
        "KVGATE_SERVED_MODEL_NAME": MODEL,
        "KVGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'kvgate.db'}",
        "KVGATE_BATCH_TICK_S": "0.1",
    }
    first, first_url = start_api(nats_server.url, tmp_path, **env)
    second, second_url = start_api(nats_server.url, tmp_path, **env)
    engine = SimEngine(SimEngineConfig(step_s=0.002, kv_capacity_tokens=8192))
    try:
        async with (
            sim_worker(engine, nats_server.url, "sim-files", ready_at=first_url),
        ):
            yield Doors(first_url, second_url)
    finally:
        first.stop()
        second.stop()


def request_line(custom_id: str, max_tokens: int = 5) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat_body(f"step {custom_id}", max_tokens, model=MODEL),
        }
    )


BATCH_END_BOUND_S = 90.0
"""For a batch of five short calls to end on the simulated engine: generous for a loaded
2-core machine."""


async def ended(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    """Followed through the SDK (not ``tests.batches.wait_for_batch``): its view of the batch is
    what is under test here."""
    return await poll_until(
        lambda: client.batches.retrieve(batch_id),
        lambda batch: batch.status in FINAL_STATUSES,
        timeout_s=BATCH_END_BOUND_S,
        interval_s=0.2,
    )


async def test_the_sdk_batch_flow_across_two_front_doors(doors: Doors) -> None:
    uploader, runner = doors.client(doors.first), doors.client(doors.second)
    stranger = doors.client(doors.first, OTHER)
    lines = [request_line(f"r{i}") for i in range(4)]
    lines.append(request_line("bad", max_tokens=-1))  # refused on its own, as an error line
    try:
        uploaded = await uploader.files.create(
            file=("requests.jsonl", "\n".join(lines).encode()), purpose="batch"
        )
        assert (uploaded.purpose, uploaded.object, uploaded.bytes) == (
            "batch",
            "file",
            len("\n".join(lines)),
        )
        # The file is the uploader's, and visible through the other front door.
        assert (await runner.files.retrieve(uploaded.id)).filename == "requests.jsonl"
        assert (await runner.files.content(uploaded.id)).content == "\n".join(lines).encode()
        with pytest.raises(openai.NotFoundError):
            await stranger.files.retrieve(uploaded.id)

        created = await runner.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"run": "sdk"},
        )
        assert created.input_file_id == uploaded.id and created.metadata == {"run": "sdk"}
        batch = await ended(uploader, created.id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed) == (5, 4)
        assert batch.request_counts.failed == 1
        assert batch.output_file_id and batch.error_file_id
        assert created.id in [b.id async for b in runner.batches.list()]

        output = (await runner.files.content(batch.output_file_id)).text
        answers = [json.loads(x) for x in output.splitlines()]
        assert [a["custom_id"] for a in answers] == ["r0", "r1", "r2", "r3"]
        for answer in answers:
            assert answer["error"] is None
            assert answer["response"]["status_code"] == 200
            assert answer["response"]["body"]["usage"]["completion_tokens"] == 5
        error_file = await uploader.files.content(batch.error_file_id)
        errors = [json.loads(x) for x in error_file.text.splitlines()]
        assert [(e["custom_id"], e["response"]) for e in errors] == [("bad", None)]
        assert errors[0]["error"]["code"] == "invalid_max_tokens"

        # Cancelling through the SDK, and deleting the input file.
        second = await uploader.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        cancelled = await runner.batches.cancel(second.id)
        assert cancelled.status in ("cancelling", "cancelled")
        assert (await ended(uploader, second.id)).status in ("cancelled", "completed")
        assert (await uploader.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await runner.files.retrieve(uploaded.id)
    finally:
        for client in (uploader, runner, stranger):
            await client.close()


async def test_a_batch_from_a_missing_file_or_for_another_endpoint_is_refused(
    doors: Doors,
) -> None:
    client = doors.client(doors.first)
    try:
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(
                input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
            )
        uploaded = await client.files.create(
            file=("x.jsonl", request_line("a").encode()), purpose="batch"
        )
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        assert refused.value.code == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError):
            await client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    finally:
        await client.close()
