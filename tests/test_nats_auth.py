"""NATS users per role (``broker/natsauth.py``): kvgate works end to end under them, and each
role is refused what it must not do. A real nats-server with the users, a real front door
(subprocess) and an in-process worker on the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS

from broker.natsauth import PASSWORD_ENV, PERMISSIONS, NatsRole, NatsUsers
from broker.natsserver import EmbeddedNats
from kvgate.cli import main
from schemas.vocab import Tier
from schemas.wire import RESULT_SUBJECT_PREFIX, STREAM_NAME, call_subject
from tests.batches import batch_results, wait_for_batch
from tests.calls import chat_body
from tests.procs import start_api
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
BATCH_BOUND_S = 60.0
"""For a batch of three lines to end on a loaded 2-core machine."""
ERROR_BOUND_S = 10.0
"""For the server's refusal of a publish to reach the client (an asynchronous error)."""


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(
        tmp_path / "nats", log_file=tmp_path / "nats.log", users=NatsUsers.generate()
    ) as server:
        yield server


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[tuple[NATS, asyncio.Queue[Exception]]]:
    """A client and the asynchronous errors the server sends it (permission violations)."""
    errors: asyncio.Queue[Exception] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        errors.put_nowait(exc)

    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False)
    try:
        yield nc, errors
    finally:
        await nc.close()


async def refused(url: str, subject: str) -> str:
    """Publish on ``subject`` as ``url``'s user; the server's refusal, as text."""
    async with connected(url) as (nc, errors):
        await nc.publish(subject, b"forged")
        await nc.flush()
        return str(await asyncio.wait_for(errors.get(), ERROR_BOUND_S))


async def test_kvgate_serves_calls_and_batches_under_its_roles_users(
    secured: EmbeddedNats, tmp_path: Path
) -> None:
    proc, base = start_api(
        secured.url_for(NatsRole.FRONT_DOOR), tmp_path, KVGATE_SERVED_MODEL_NAME=MODEL
    )
    engine = SimEngine(SimEngineConfig(step_s=0.004, kv_capacity_tokens=4096))
    try:
        async with (
            sim_worker(engine, secured.url_for(NatsRole.WORKER), "sim-auth", ready_at=base),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            answer = await client.post("/v1/chat/completions", json=chat_body(model=MODEL))
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = chat_body(model=MODEL, max_tokens=4, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                text = "".join([chunk async for chunk in stream.aiter_text()])
            assert stream.status_code == 200 and text.endswith("data: [DONE]\n\n"), text
            # A caller that goes away mid-stream: the front door cancels the call on the worker.
            long: dict[str, Any] = chat_body(model=MODEL, max_tokens=400, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=long) as stream:
                await anext(stream.aiter_bytes())
            lines = [
                {"custom_id": f"c{i}", "session": "s", "body": chat_body(model=MODEL)}
                for i in range(3)
            ]
            created = await client.post("/v1/batches", json={"requests": lines})
            assert created.status_code == 201, created.text
            done = await wait_for_batch(client, created.json()["id"], timeout_s=BATCH_BOUND_S)
            assert done["status"] == "completed", done
            results = await batch_results(client, created.json()["id"])
            assert sorted(r["custom_id"] for r in results) == ["c0", "c1", "c2"]
    finally:
        proc.stop()
    # Nothing kvgate did (calls, cancels, heartbeats, results, the worker's leaving) was refused.
    assert "Violation" not in (tmp_path / "nats.log").read_text()


async def test_each_role_is_refused_what_it_must_not_do(secured: EmbeddedNats) -> None:
    front_door = secured.url_for(NatsRole.FRONT_DOOR)
    worker = secured.url_for(NatsRole.WORKER)
    # Only front doors queue calls, past admission; only workers publish results.
    assert (
        "permissions violation"
        in (await refused(worker, call_subject(Tier.GUARANTEED, MODEL))).lower()
    )
    assert "permissions violation" in (await refused(worker, "kvgate.cancel.call_x")).lower()
    assert (
        "permissions violation"
        in (await refused(front_door, f"{RESULT_SUBJECT_PREFIX}batch_x")).lower()
    )
    # A worker may not remove what is queued.
    assert (
        "permissions violation"
        in (await refused(worker, f"$JS.API.STREAM.PURGE.{STREAM_NAME}")).lower()
    )


async def answer_to_connect(server: EmbeddedNats, credentials: dict[str, str]) -> str:
    """The server's answer to a client that connects with ``credentials``, on a raw socket
    (nats.py leaves its socket open when the server refuses it)."""
    assert server.port is not None
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        await reader.readline()  # the server's INFO
        connect = json.dumps({"verbose": False, "pedantic": False, **credentials})
        writer.write(f"CONNECT {connect}\r\nPING\r\n".encode())
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), ERROR_BOUND_S)).decode()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_connection_without_a_user_is_refused(secured: EmbeddedNats) -> None:
    assert "Authorization Violation" in await answer_to_connect(secured, {})
    wrong = {"user": NatsRole.FRONT_DOOR.value, "pass": "not-the-password"}
    assert "Authorization Violation" in await answer_to_connect(secured, wrong)
    right = {"user": NatsRole.WORKER.value, "pass": users_of(secured).passwords[NatsRole.WORKER]}
    assert (await answer_to_connect(secured, right)).startswith("PONG")


def users_of(server: EmbeddedNats) -> NatsUsers:
    assert server.users is not None
    return server.users


def test_passwords_from_the_environment_are_both_or_neither_and_fit_a_url() -> None:
    assert NatsUsers.from_env({}) is None
    both = {
        "KVGATE_NATS_FRONTDOOR_PASSWORD": "f" * 16,
        "KVGATE_NATS_WORKER_PASSWORD": "w" * 16,
    }
    users = NatsUsers.from_env(both)
    assert users is not None
    assert users.url("nats://127.0.0.1:4222", NatsRole.WORKER) == (
        "nats://worker:wwwwwwwwwwwwwwww@127.0.0.1:4222"
    )
    with pytest.raises(ValueError, match="KVGATE_NATS_WORKER_PASSWORD is not set"):
        NatsUsers.from_env({"KVGATE_NATS_FRONTDOOR_PASSWORD": "f" * 16})
    with pytest.raises(ValueError, match="at least 16 characters"):
        NatsUsers.from_env({**both, "KVGATE_NATS_WORKER_PASSWORD": "p@ss/word:with-odd"})


def test_kvgate_nats_refuses_a_network_bind_without_users(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in PASSWORD_ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert main(["nats", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate nats: ") and "KVGATE_NATS_WORKER_PASSWORD" in err


def test_kvgate_nats_prints_the_users_for_an_operators_own_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_NATS_FRONTDOOR_PASSWORD", "f" * 16)
    monkeypatch.setenv("KVGATE_NATS_WORKER_PASSWORD", "w" * 16)
    assert main(["nats", "--print-config"]) == 0
    users = json.loads(capsys.readouterr().out)["authorization"]["users"]
    assert [(u["user"], u["password"]) for u in users] == [
        ("frontdoor", "f" * 16),
        ("worker", "w" * 16),
    ]
    assert users[1]["permissions"] == PERMISSIONS[NatsRole.WORKER]
