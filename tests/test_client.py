"""kvgate's client for agents (``kvgate/client.py``) against live front doors: the shared
``stack`` (a real vLLM CPU worker) for sessions that run, a front door with no worker for the
refusals, and a simulated worker that arrives while a session waits."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import random
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import pytest
from openai import APIConnectionError, AsyncOpenAI, BadRequestError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from api.chat_request import SESSION_HEADER
from broker.natsserver import EmbeddedNats
from broker.procs import free_port
from kvgate import client as kvgate_client
from kvgate.client import GaveUp, SessionNotOpened, kvgate_session
from tests.conftest import Stack
from tests.polling import poll_until
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

Connect = Callable[[str], OpenAI]
MODEL = "kvgate-dev"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
SERVER_PACKAGES = frozenset(
    {"api", "broker", "workers", "schemas", "fastapi", "nats", "redis", "msgspec", "sqlalchemy"}
    | {"sqlmodel", "vllm", "torch", "opentelemetry", "uvicorn"}
)
AT_ONCE_BOUND_S = 2.0
"""A refusal that waiting cannot help is given up on without waiting: well under this on a
loaded 2-core machine."""


@pytest.fixture
def connect() -> Iterator[Connect]:
    """An ``openai`` client on the front door at a base URL, closed after the test."""
    with contextlib.ExitStack() as opened:
        yield lambda base_url: opened.enter_context(
            OpenAI(base_url=base_url + "/v1", api_key="unused")
        )


def session_state(base_url: str, session_id: str) -> dict[str, object]:
    resp = httpx.get(f"{base_url}/v1/sessions/{session_id}", timeout=10)
    resp.raise_for_status()
    body: dict[str, object] = resp.json()
    return body


def test_the_client_imports_nothing_of_the_server() -> None:
    code = "import sys, kvgate.client; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = set(ast.literal_eval(out))
    assert "openai" in loaded
    assert not loaded & SERVER_PACKAGES, loaded & SERVER_PACKAGES
    assert kvgate_client.SESSION_HEADER == SESSION_HEADER


def test_a_session_names_itself_on_every_call_and_is_closed_after(
    stack: Stack, connect: Connect
) -> None:
    client = connect(stack.base_url)
    with kvgate_session(
        client,
        tier="standard",
        max_parallel=2,
        expected_calls=2,
        est_prompt_tokens=16,
        est_output_tokens=4,
    ) as s:
        assert (s.tier, s.max_parallel, s.attempts) == ("standard", 2, 1)
        for _ in range(2):
            reply = s.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert reply.choices[0].message.content is not None
        inside = session_state(stack.base_url, s.id)
    assert (inside["state"], inside["calls_started"]) == ("active", 2)
    assert session_state(stack.base_url, s.id)["state"] == "closed"


def test_a_session_is_closed_when_its_block_fails(stack: Stack, connect: Connect) -> None:
    client = connect(stack.base_url)
    with (
        pytest.raises(RuntimeError),
        kvgate_session(client, est_prompt_tokens=16, est_output_tokens=4) as s,
    ):
        raise RuntimeError("the agent failed")
    assert session_state(stack.base_url, s.id)["state"] == "closed"


async def test_an_async_session_streams_through_the_client_it_hands_out(stack: Stack) -> None:
    client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    async with (
        client,
        kvgate_session(client, tier="besteffort", est_prompt_tokens=16, est_output_tokens=4) as s,
    ):
        stream = await s.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks
        inside = session_state(stack.base_url, s.id)
    assert (inside["tier"], inside["calls_started"]) == ("besteffort", 1)
    assert session_state(stack.base_url, s.id)["state"] == "closed"


def test_a_session_larger_than_the_fleet_is_given_up_on_unless_asked_to_wait(
    stack: Stack, connect: Connect
) -> None:
    huge = {"max_parallel": 256, "min_parallel": 256, "est_prompt_tokens": 4000}
    resp = httpx.post(
        f"{stack.base_url}/v1/sessions",
        json={"tier": "standard", "est_output_tokens": 4000, **huge},
    )
    assert (resp.status_code, resp.json()["error"]["code"]) == (503, "exceeds_capacity")
    # The fleet may grow: kvgate says try again in about a minute (jittered down by up to a
    # fifth).
    assert resp.headers["x-should-retry"] == "true"
    assert 48 <= int(resp.headers["retry-after"]) <= 60

    client = connect(stack.base_url)
    for waits, why in ((False, GaveUp.WAITING_WILL_NOT_HELP), (True, GaveUp.PAST_DEADLINE)):
        # Asked to wait for the fleet to grow, it still waits no longer than its deadline.
        opening = kvgate_session(
            client,
            deadline_s=30,
            est_output_tokens=4000,
            extra=huge,
            wait_for_fleet_growth=waits,
        )
        with pytest.raises(SessionNotOpened) as refused, opening:
            pytest.fail("admitted")
        gave_up = refused.value
        assert (gave_up.why, gave_up.code, gave_up.status) == (why, "exceeds_capacity", 503)
        assert (gave_up.attempts, gave_up.refusals) == (1, 1)
        assert gave_up.retry_after is not None and 48 <= gave_up.retry_after <= 60
        assert gave_up.waited_s < AT_ONCE_BOUND_S


def test_a_deferred_session_is_retried_within_its_budget(lonely_api: str, connect: Connect) -> None:
    resp = httpx.post(f"{lonely_api}/v1/sessions", json={"tier": "standard", "max_wait_s": 0})
    assert (resp.status_code, resp.json()["error"]["code"]) == (503, "no_workers")
    assert resp.headers["x-should-retry"] == "true"
    retry_after = float(resp.headers["retry-after"])

    client = connect(lonely_api)
    opening = kvgate_session(client, max_wait_s=0, retry_budget=1, jitter=0)
    with pytest.raises(SessionNotOpened) as refused, opening:
        pytest.fail("admitted")
    gave_up = refused.value
    assert (gave_up.why, gave_up.code, gave_up.attempts) == (
        GaveUp.RETRY_BUDGET_SPENT,
        "no_workers",
        2,
    )
    # One wait of the Retry-After kvgate named (it varies by a second between answers).
    assert retry_after - 1 <= gave_up.waited_s


def test_an_unreachable_front_door_is_reported_as_such(connect: Connect) -> None:
    client = connect(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(SessionNotOpened) as refused, kvgate_session(client, retry_budget=1):
        pytest.fail("admitted")
    assert (refused.value.why, refused.value.attempts) == (GaveUp.UNREACHABLE, 2)
    assert isinstance(refused.value.__cause__, APIConnectionError)


def test_a_request_kvgate_cannot_take_is_raised_as_openai_raises_it(
    lonely_api: str, connect: Connect
) -> None:
    client = connect(lonely_api)
    with pytest.raises(BadRequestError) as bad, kvgate_session(client, tier="gold"):
        pytest.fail("admitted")
    assert bad.value.code == "invalid_tier"


async def test_a_session_deferred_for_want_of_a_worker_runs_once_one_comes(
    lonely_api: str, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=kvgate_client.__name__)

    async def agent(client: AsyncOpenAI) -> tuple[int, int, str | None]:
        # A budget of ten waits of 4-6 s: a minute for the worker to start and be seen.
        async with kvgate_session(
            client,
            max_wait_s=0,
            retry_budget=10,
            rng=random.Random(1),
            est_prompt_tokens=16,
            est_output_tokens=4,
        ) as s:
            reply = await s.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            return s.attempts, s.refusals, reply.choices[0].message.content

    async with AsyncOpenAI(base_url=lonely_api + "/v1", api_key="unused") as client:
        running = asyncio.create_task(agent(client))
        try:
            await poll_until(
                lambda: asyncio.sleep(0),
                lambda _: any("deferred" in r.message for r in caplog.records),
                timeout_s=AT_ONCE_BOUND_S * 5,
            )
            engine = SimEngine(
                SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192, served_model_name=MODEL)
            )
            async with sim_worker(engine, nats_server.url, "w1", ready_at=lonely_api):
                attempts, refusals, content = await running
        finally:
            running.cancel()
    assert attempts >= 2 and refusals == attempts - 1
    assert content
