"""Streaming clients that stop reading (issue 14: "slow readers do not slow fast ones", "SSE
writes have no send timeout"): a real front door (subprocess) and an in-process worker on the
simulated engine; the slow client is a raw socket with a tiny receive window that reads its
response's head and then nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from broker.natsserver import EmbeddedNats
from tests.calls import chat_body
from tests.chaos import metrics
from tests.polling import poll_until
from tests.procs import start_api
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
SEND_TIMEOUT_S = 2.0
LONG_TOKENS = 40_000
"""An answer of several megabytes of events: more than the socket buffers between the front door
and a client that reads nothing can hold (the kernel lets a send buffer grow to 4 MiB)."""
CUT_BOUND_S = 60.0
"""For the stalled client to be cut off and its call to end: the answer must first fill the
buffers (~10-15 s of the engine's output here), then one write waits ``SEND_TIMEOUT_S``.
Without the send timeout the front door follows the call for as long as the socket is open."""
IDLE_HELD = 4
"""Connections a test's front door may hold at once (``KVGATE_MAX_CONNECTIONS``)."""


@pytest.fixture
async def door(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[tuple[str, SimEngine]]:
    proc, base = start_api(
        nats_server.url,
        tmp_path,
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_STREAM_SEND_TIMEOUT_S=str(SEND_TIMEOUT_S),
        KVGATE_MAX_TOKENS_LIMIT=str(LONG_TOKENS),
    )
    engine = SimEngine(
        SimEngineConfig(step_s=0.0001, kv_capacity_tokens=100_000, max_model_len=50_000)
    )
    try:
        async with sim_worker(engine, nats_server.url, "sim-slow", ready_at=base):
            yield base, engine
    finally:
        proc.stop()


@contextlib.asynccontextmanager
async def stalled_stream(base: str) -> AsyncIterator[socket.socket]:
    """A streamed call whose client reads the response's head, then nothing."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    body = json.dumps(chat_body("tell a long story", LONG_TOKENS, model=MODEL, stream=True))
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    await loop.sock_sendall(sock, request.encode())
    head = await asyncio.wait_for(loop.sock_recv(sock, 512), CUT_BOUND_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    try:
        yield sock
    finally:
        sock.close()


async def test_a_client_that_stops_reading_is_cut_off_and_its_call_cancelled(
    door: tuple[str, SimEngine],
) -> None:
    base, engine = door
    async with stalled_stream(base):
        started = time.monotonic()
        # Its call is ended (the engine runs nothing) and the front door follows nothing,
        # while the client still holds its socket open.
        await poll_until(
            lambda: metrics(base),
            lambda m: m["kvgate_calls_open"] == 0 and not engine._running,
            timeout_s=CUT_BOUND_S,
            interval_s=0.5,
        )
        print(f"stalled client cut off after {time.monotonic() - started:.1f} s")
        # A client that reads still gets its whole answer.
        async with httpx.AsyncClient(base_url=base, timeout=CUT_BOUND_S) as client:
            answer = await client.post("/v1/chat/completions", json=chat_body(model=MODEL))
        assert answer.status_code == 200, answer.text


async def test_connections_past_the_limit_are_refused_at_once(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc, base = start_api(nats_server.url, tmp_path, KVGATE_MAX_CONNECTIONS=str(IDLE_HELD))
    host, port = base.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(IDLE_HELD):  # clients that connect and send nothing (slowloris)
            held.append(await asyncio.open_connection(host, int(port)))
        async with httpx.AsyncClient(base_url=base, timeout=CUT_BOUND_S) as client:
            refused = await client.get("/healthz")
        assert refused.status_code == 503
    finally:
        for _, writer in held:
            writer.close()
        proc.stop()
