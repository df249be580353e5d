"""Two thousand streaming clients at once, some of them reading very slowly (issue 14's fault
table): the front door's memory stays within a stated bound, its event loop keeps answering,
and the slow readers do not slow the fast ones. A real front door (subprocess) and an
in-process worker on the simulated engine; the clients are raw sockets, one coroutine each, so
that the load client is light beside what it measures."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from broker.natsserver import EmbeddedNats
from loadtests.stats import percentile
from tests.calls import chat_body
from tests.procs import mib, resident_bytes, start_api
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
READERS = 2_000
SLOW_SHARE = 0.1
"""Of the readers, these read one small chunk a second through a 4 KiB receive window."""
SESSIONS = 8
TOKENS = 12
STEP_S = 0.25
"""The engine's step: a call streams for ~3 s, so that every stream is open at once."""
MEMORY_BOUND_BYTES = 400 << 20
"""The front door's resident memory with every stream open, above its reading at rest: ~200 KiB
a stream (its task, its buffers, its connection), stated once."""
LOOP_STALL_BOUND_S = 5.0
"""The slowest ``/healthz`` answer while the streams run: the front door's loop is busy (it
relays ~8,000 events a second on a machine it shares with the load), but never stops."""
SLOWDOWN_BOUND = 2.0
"""Fast readers' median time to their last event with the slow readers beside them, over the
same without: side by side on one front door, generous for a noisy 2-core machine."""
READ_BOUND_S = 120.0


@dataclass
class Read:
    seconds: float
    events: int
    done: bool
    head: bytes
    """The response's first bytes: its status line, and an error's body."""


@pytest.fixture
async def door(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    proc, base = start_api(
        nats_server.url,
        tmp_path,
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_SESSION_MAX_PARALLEL=str(READERS),
        KVGATE_SESSION_MAX_WAITING_CALLS=str(READERS),
    )
    engine = SimEngine(
        SimEngineConfig(max_num_seqs=READERS + 64, kv_capacity_tokens=400_000, step_s=STEP_S)
    )
    try:
        async with sim_worker(engine, nats_server.url, "sim-readers", ready_at=base):
            yield base, proc.pid
    finally:
        proc.stop()


async def read_stream(base: str, session_id: str, *, slow: bool) -> Read:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(sock=await _connected(sock, host, int(port)))
    body = json.dumps(chat_body("hello", TOKENS, model=MODEL, stream=True))
    writer.write(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-Kvgate-Session: "
            f"{session_id}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}"
        ).encode()
    )
    received = bytearray()
    try:
        while b"data: [DONE]" not in received[-64:]:
            chunk = await (reader.read(256) if slow else reader.read(65536))
            if not chunk:
                break
            received += chunk
            if slow:
                await asyncio.sleep(1.0)
    finally:
        writer.close()
    done = b"data: [DONE]" in received
    return Read(time.monotonic() - started, received.count(b"data: "), done, bytes(received[:600]))


async def _connected(sock: socket.socket, host: str, port: int) -> socket.socket:
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return sock


async def sessions(base: str) -> list[str]:
    async with httpx.AsyncClient(base_url=base, timeout=READ_BOUND_S) as client:
        ids = []
        for _ in range(SESSIONS):
            created = await client.post(
                "/v1/sessions",
                json={
                    "tier": "standard",
                    "max_parallel": READERS // SESSIONS,
                    "expected_calls": READERS // SESSIONS,
                    "est_prompt_tokens": 16,
                    "est_output_tokens": TOKENS,
                },
            )
            assert created.status_code == 201, created.text
            ids.append(created.json()["id"])
        return ids


async def probe_loop(base: str, stop: asyncio.Event) -> list[float]:
    """``/healthz`` latencies, one after another, until ``stop``."""
    latencies = []
    async with httpx.AsyncClient(base_url=base, timeout=READ_BOUND_S) as client:
        while not stop.is_set():
            started = time.monotonic()
            await client.get("/healthz")
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.1)
    return latencies


async def run_readers(base: str, pid: int, *, slow_share: float) -> tuple[list[Read], int]:
    """Every reader at once; their reads and the front door's peak resident memory."""
    ids = await sessions(base)
    slow = int(READERS * slow_share)
    peak = 0
    stop = asyncio.Event()

    async def watch_memory() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, resident_bytes(pid))
            await asyncio.sleep(0.2)

    readers = [read_stream(base, ids[i % SESSIONS], slow=i < slow) for i in range(READERS)]
    watcher = asyncio.create_task(watch_memory())
    try:
        reads = await asyncio.wait_for(asyncio.gather(*readers), READ_BOUND_S)
    finally:
        stop.set()
        await watcher
    async with httpx.AsyncClient(base_url=base) as client:
        for session_id in ids:
            await client.delete(f"/v1/sessions/{session_id}")
    return list(reads), peak


async def test_two_thousand_readers_some_slow_hold_memory_and_do_not_slow_the_fast(
    door: tuple[str, int],
) -> None:
    base, pid = door
    at_rest = resident_bytes(pid)
    stop = asyncio.Event()
    probes = asyncio.create_task(probe_loop(base, stop))
    alone, _ = await run_readers(base, pid, slow_share=0)
    mixed, peak = await run_readers(base, pid, slow_share=SLOW_SHARE)
    stop.set()
    latencies = await probes
    slow = int(READERS * SLOW_SHARE)
    fast_alone = statistics.median(r.seconds for r in alone[slow:])
    fast_mixed = statistics.median(r.seconds for r in mixed[slow:])
    p50, p99 = (percentile(latencies, q) or 0.0 for q in (50, 99))
    print(
        f"\n{READERS} readers ({slow} slow): front door {mib(at_rest)} MiB at rest, peak "
        f"{mib(peak)} MiB; fast readers' median {fast_alone:.2f} s alone, {fast_mixed:.2f} s "
        f"beside the slow; /healthz p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max "
        f"{max(latencies) * 1000:.0f} ms"
    )
    assert all(r.done and r.events == TOKENS + 1 for r in alone + mixed), [
        r for r in alone + mixed if not r.done or r.events != TOKENS + 1
    ][:5]
    assert peak - at_rest <= MEMORY_BOUND_BYTES
    assert max(latencies) <= LOOP_STALL_BOUND_S
    assert fast_mixed <= fast_alone * SLOWDOWN_BOUND
