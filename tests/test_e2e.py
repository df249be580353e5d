"""End to end: real NATS, a real vLLM CPU worker, the real front door served by uvicorn."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import nats
import openai
import pytest
from nats.aio.msg import Msg

from api.chat_request import TIER_HEADER
from schemas.wire import CALL_SUBJECT_PREFIX, CallEnvelope, decode_call
from tests.calls import MODEL, chat_body
from tests.conftest import Stack
from tests.polling import poll_until
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker

CLIENT_TIMEOUT_S = 60
"""A short call on the CPU engine shared with the other tests' load: far more than it takes."""
FLEET_CHANGE_BOUND_S = 15
"""For the front door to see a worker come or go (heartbeats every 0.3 s, a KV watch), or a
simulated worker to drain: generous for a loaded 2-core machine."""
DISCONNECT_WINDOW_S = 0.3
"""How long the front door is given to read the disconnect before its log is read: nothing
observable says it has (a clean disconnect logs nothing), so this is a window in which an
error, if any, would be logged."""


def sse_events(raw: bytes) -> list[str]:
    # Split on "\n" only: the small model emits characters that str.splitlines() treats as
    # line ends.
    return [
        line.removeprefix("data: ")
        for line in raw.decode().split("\n")
        if line.startswith("data: ")
    ]


async def test_readyz_reports_the_worker(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 200
    assert resp.json()["checks"] == {"nats": True, "stream": True, "workers": 1}


async def test_models_lists_the_served_model(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        resp = await client.get("/v1/models")
    assert resp.status_code == 200
    (card,) = resp.json()["data"]
    assert card["id"] == MODEL
    assert card["max_model_len"] == 1024  # the test worker's setting (tests/procs.py)


def model_ids(resp: httpx.Response) -> list[str]:
    return [m["id"] for m in resp.json()["data"]]


async def test_each_model_is_routed_to_the_workers_that_serve_it(stack: Stack) -> None:
    """A second worker serving another model (a simulated engine: the routing under test is
    NATS's, and a second vLLM engine would not fit beside the first on two cores)."""
    other = "org/sim.model-b"
    engine = SimEngine(SimEngineConfig(served_model_name=other, max_model_len=512, step_s=0.002))
    options = WorkerSettings(
        nats_url=stack.nats.url, worker_id="sim-b", pull_expires_s=2, heartbeat_interval_s=0.3
    )
    worker = Worker(engine, options)
    task = asyncio.create_task(worker.run())
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        try:
            listed = await poll_until(
                lambda: client.get("/v1/models"),
                lambda r: other in model_ids(r),
                timeout_s=2 * FLEET_CHANGE_BOUND_S,  # and the worker starts first
            )
            cards = {m["id"]: m for m in listed.json()["data"]}
            assert sorted(cards) == sorted([MODEL, other])
            assert cards[other]["max_model_len"] == 512
            for _ in range(3):
                for model, worker_id in ((MODEL, "w1"), (other, "sim-b")):
                    resp = await client.post(
                        "/v1/chat/completions", json=chat_body(model=model, max_tokens=4)
                    )
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["x-kvgate-worker"] == worker_id
                    assert resp.json()["model"] == model
            streamed = await client.post(
                "/v1/chat/completions", json=chat_body(model=other, max_tokens=4, stream=True)
            )
            assert streamed.headers["x-kvgate-worker"] == "sim-b"
            assert sse_events(streamed.content)[-1] == "[DONE]"

            unknown = await client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
            assert unknown.status_code == 404
            error = unknown.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert MODEL in error["message"] and other in error["message"]
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, FLEET_CHANGE_BOUND_S)
        # A worker that stops takes its heartbeat with it: its model is no longer served.
        await poll_until(
            lambda: client.get("/v1/models"),
            lambda r: model_ids(r) == [MODEL],
            timeout_s=FLEET_CHANGE_BOUND_S,
        )
        gone = await poll_until(
            lambda: client.post("/v1/chat/completions", json=chat_body(model=other)),
            lambda r: r.status_code != 503,  # 503 no_workers while its last beat says draining
            timeout_s=FLEET_CHANGE_BOUND_S,
        )
        assert gone.status_code == 404, gone.text


async def test_non_streamed_completion_over_http(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=9))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 9
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 9
    assert resp.headers["x-kvgate-call"]
    assert resp.headers["x-kvgate-worker"] == "w1"  # the worker that answered
    assert int(resp.headers["x-kvgate-queue-wait-ms"]) >= 0  # how long it queued before the engine


async def test_a_call_carries_its_tiers_first_token_objective_to_the_worker(
    stack: Stack,
) -> None:
    # The worker's rescue rule (workers/headroom.py) times a call by the objective the front
    # door sends with it: the tier's, here the default tenants' (broker/admission/tenants.py).
    client = await nats.connect(stack.nats.url)
    try:
        seen: asyncio.Queue[CallEnvelope] = asyncio.Queue()

        async def keep(msg: Msg) -> None:
            await seen.put(decode_call(msg.data))

        await client.subscribe(CALL_SUBJECT_PREFIX + ">", cb=keep)
        await client.flush()
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as http:
            for tier, objective_ms in (("standard", 3000), ("besteffort", 30000)):
                resp = await http.post(
                    "/v1/chat/completions",
                    json=chat_body(max_tokens=2),
                    headers={TIER_HEADER: tier},
                )
                assert resp.status_code == 200, resp.text
                envelope = await asyncio.wait_for(seen.get(), CLIENT_TIMEOUT_S)
                assert envelope.call_id == resp.headers["x-kvgate-call"]
                assert envelope.tier.value == tier
                assert envelope.ttft_objective_ms == objective_ms
    finally:
        await client.close()


async def test_streamed_completion_over_http(stack: Stack) -> None:
    body = chat_body(max_tokens=12, stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-kvgate-worker"] == "w1"
    assert int(resp.headers["x-kvgate-queue-wait-ms"]) >= 0
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finish_at = next(
        i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]
    )
    content = [c["choices"][0]["delta"].get("content") for c in chunks[:finish_at] if c["choices"]]
    assert "".join(x or "" for x in content), "no content before the finish chunk"
    assert chunks[finish_at]["choices"][0]["finish_reason"] == "length"
    # The usage chunk comes last, with no choices.
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert finish_at == len(chunks) - 2


async def test_openai_client_non_streamed_and_streamed(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    try:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].message.content
        assert completion.usage is not None and completion.usage.completion_tokens == 6

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert text
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 6
    finally:
        await client.close()


async def test_concurrent_calls_get_their_own_replies(stack: Stack) -> None:
    """Two calls in flight at once, each with a distinct prompt length and max_tokens: each
    answer carries exactly its own counts, so no event crossed between reply inboxes."""
    long_prompt = " ".join(["the agent reads the file"] * 30)
    cases = [("hi", 7), (long_prompt, 23)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        solo = [
            (await client.post("/v1/chat/completions", json=chat_body(p, 1))).json()["usage"]
            for p, _ in cases
        ]

        async def one(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
            extra: dict[str, Any] = {}
            if stream:
                extra = {"stream": True, "stream_options": {"include_usage": True}}
            resp = await client.post(
                "/v1/chat/completions", json=chat_body(prompt, max_tokens, **extra)
            )
            assert resp.status_code == 200, resp.text
            if not stream:
                return dict(resp.json()["usage"])
            events = sse_events(resp.content)
            return dict(json.loads(events[-2])["usage"])

        for stream in (False, True):
            usages = await asyncio.gather(*(one(p, n, stream) for p, n in cases))
            for usage, (_, max_tokens), alone in zip(usages, cases, solo, strict=True):
                assert usage["completion_tokens"] == max_tokens
                assert usage["prompt_tokens"] == alone["prompt_tokens"]
    assert solo[0]["prompt_tokens"] < solo[1]["prompt_tokens"]


BAD_INPUTS = [
    pytest.param(b"{not json", 400, "invalid_json", id="malformed-json"),
    pytest.param(b"[1, 2]", 400, "invalid_request", id="not-an-object"),
    pytest.param(json.dumps({"model": MODEL}).encode(), 400, "missing_messages", id="no-messages"),
    pytest.param(
        json.dumps({"model": MODEL, "messages": []}).encode(),
        400,
        "invalid_messages",
        id="empty-messages",
    ),
    pytest.param(
        json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
        400,
        "invalid_messages",
        id="bad-role",
    ),
    pytest.param(
        json.dumps(chat_body(max_tokens=-5)).encode(),
        400,
        "invalid_max_tokens",
        id="negative-max-tokens",
    ),
    pytest.param(
        json.dumps(chat_body(max_tokens=10**9)).encode(),
        400,
        "max_tokens_too_large",
        id="huge-max-tokens",
    ),
    pytest.param(
        json.dumps({**chat_body(), "max_tokens": "lots"}).encode(),
        400,
        "invalid_max_tokens",
        id="string-max-tokens",
    ),
    pytest.param(
        json.dumps({**chat_body(), "model": "gpt-nope"}).encode(),
        404,
        "model_not_found",
        id="unknown-model",
    ),
    pytest.param(
        json.dumps({**chat_body(), "temperature": 9}).encode(),
        400,
        "invalid_parameter",
        id="bad-temperature",
    ),
    pytest.param(
        json.dumps({**chat_body(), "n": 0}).encode(), 400, "invalid_parameter", id="n-below-1"
    ),
    pytest.param(
        json.dumps(chat_body(content="x" * (2 << 20))).encode(),
        413,
        "body_too_large",
        id="oversized-body",
    ),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_INPUTS)
async def test_bad_input_gets_its_code_and_the_server_keeps_serving(
    stack: Stack, body: bytes, status: int, code: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        resp = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["code"] == code
        assert error["message"]
        assert set(error) == {"message", "type", "code", "param"}
        ok = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert ok.status_code == 200


async def test_prompt_longer_than_the_context_is_a_400_from_the_worker(stack: Stack) -> None:
    body = chat_body(content=" ".join(["token"] * 3000), max_tokens=4)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json={**body, "stream": stream})
            assert resp.status_code == 400
            assert resp.json()["error"]["code"] == "context_length_exceeded"


async def test_openai_client_sees_the_error_code(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(
                model="gpt-nope", messages=[{"role": "user", "content": "x"}]
            )
        assert caught.value.code == "model_not_found"
    finally:
        await client.close()


async def test_unknown_route_and_method_are_json_errors(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        missing = await client.get("/v2/nothing")
        wrong = await client.get("/v1/chat/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


async def test_a_caller_gone_before_its_body_was_read_is_no_server_error(stack: Stack) -> None:
    # An agent giving up on a call can close the connection before the front door has read
    # the request body: nothing was admitted, nobody reads an answer, nothing is logged as an
    # error, and the front door keeps serving.
    host, port = stack.base_url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
        b"Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n" + b'{"model": '
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.sleep(DISCONNECT_WINDOW_S)  # the front door reads the disconnect
        after = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert after.status_code == 200
    log = (stack.log_dir / f"api-{port}.log").read_text()
    assert "ClientDisconnect" not in log
    assert "unhandled error" not in log


def test_kvgate_workers_lists_the_live_worker(stack: Stack) -> None:
    import subprocess

    from kvgate.cli import COMMAND

    table = subprocess.run(
        [*COMMAND, "workers", "--nats-url", stack.nats.url],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    header, row = table.strip().splitlines()
    assert header.split()[:3] == ["WORKER", "MODEL", "KV"]
    assert row.split()[:2] == ["w1", MODEL]
    listed = subprocess.run(
        [*COMMAND, "workers", "--nats-url", stack.nats.url, "--json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (worker,) = json.loads(listed)
    assert worker["worker_id"] == "w1"
    assert worker["kv_capacity_tokens"] == 2048
    assert worker["max_num_seqs"] == 16
