"""Worker faults with real processes: two vLLM CPU workers, a short ack wait (3 s), SIGKILL
mid-generation and SIGTERM drains. No call may be lost or answered twice."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from broker.natsserver import EmbeddedNats
from schemas.wire import STREAM_NAME
from tests.procs import Proc, start_api, start_worker
from tests.sampler import FleetSampler, sample_fleet

ACK_WAIT_S = 3
STREAM_ENV = {"KVGATE_STREAM_ACK_WAIT_S": str(ACK_WAIT_S)}


class FaultStack:
    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        self.nats = EmbeddedNats(root / "nats", log_file=root / "nats.log").start()
        self.api, self.base_url = start_api(self.nats.url, root, **STREAM_ENV)
        self.workers: dict[str, Proc] = {}
        self._names = (f"f{i}" for i in itertools.count())

    def spawn(self) -> str:
        name = next(self._names)
        # Heartbeats every 0.2 s: a test sees which worker holds a call well before the call
        # can finish, so a kill lands mid-generation.
        self.workers[name] = start_worker(
            self.nats.url,
            self.model,
            self.root,
            name,
            KVGATE_WORKER_HEARTBEAT_INTERVAL_S="0.2",
            **STREAM_ENV,
        )
        return name

    def close(self) -> None:
        self.api.stop()
        for proc in self.workers.values():
            proc.stop()
        self.nats.stop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, dev_model: Path) -> Iterator[FaultStack]:
    stack = FaultStack(tmp_path_factory.mktemp("faults"), dev_model)
    try:
        stack.spawn()
        stack.spawn()
        yield stack
    finally:
        stack.close()


@pytest.fixture
async def fleet(faults: FaultStack) -> AsyncIterator[FleetSampler]:
    async with sample_fleet(faults.nats.url, workers=2, timeout=240) as sampler:
        yield sampler


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "kvgate-dev",
        "messages": [{"role": "user", "content": "write the plan"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def committed(fleet: FleetSampler) -> dict[str, int]:
    return {hb.worker_id: hb.committed_tokens for hb in fleet.workers()}


async def holders(
    fleet: FleetSampler,
    calls: int,
    alive: Iterable[str],
    before: dict[str, int],
    timeout: float = 20,
) -> dict[str, int]:
    """Workers running the calls a test just sent, once ``calls`` are running in all: a worker
    counts only if it is in ``alive`` (a worker killed by an earlier test leaves its last
    heartbeat in the bucket until the entry expires) and its own reservations grew since
    ``before`` (taken just before the calls were sent), so that no earlier reading, stale or
    not, is mistaken for this test's call."""
    names = set(alive)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = {
            hb.worker_id: hb.num_running
            for hb in fleet.workers()
            if hb.worker_id in names
            and hb.num_running
            and hb.committed_tokens > before.get(hb.worker_id, 0)
        }
        if sum(running.values()) >= calls:
            return running
        await asyncio.sleep(0.05)
    raise AssertionError(f"{calls} calls never ran at once: {fleet.workers()}")


def kill(proc: Proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the worker and its engine core process
    proc.wait(10)
    proc.stop()


async def stream_is_empty(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(STREAM_NAME)).state.messages == 0
    finally:
        await nc.close()


async def test_sigterm_finishes_running_calls_and_exits_zero(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    async with httpx.AsyncClient(base_url=faults.base_url, timeout=120) as client:
        before = committed(fleet)
        calls = [
            asyncio.create_task(client.post("/v1/chat/completions", json=body(400)))
            for _ in range(3)
        ]
        # Stop a worker that is running calls; whether the three run side by side or one
        # after another depends on the machine's load, not on what is tested here.
        running = await holders(fleet, 1, faults.workers, before)
        name = max(running, key=lambda k: running[k])
        worker = faults.workers[name]
        worker.signal(signal.SIGTERM)
        # The draining worker takes no new work: a call sent now is served by the other one.
        after = await client.post("/v1/chat/completions", json=body(20))
        replies = await asyncio.gather(*calls)
        assert worker.wait(timeout=40) == 0, worker.tail()
    assert after.status_code == 200
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 400
    faults.workers.pop(name).stop()
    faults.spawn()  # back to two workers for the next tests (ready in ~30 s)
    assert await stream_is_empty(faults.nats.url)


async def test_sigkill_mid_generation_redelivers_a_non_streamed_call(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    async with httpx.AsyncClient(base_url=faults.base_url, timeout=120) as client:
        started = time.monotonic()
        before = committed(fleet)
        call = asyncio.create_task(client.post("/v1/chat/completions", json=body(960)))
        (name,) = await holders(fleet, 1, faults.workers, before)
        kill(faults.workers.pop(name))
        reply = await call
        elapsed = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    # One complete answer, from the worker the call was redelivered to after the ack wait.
    assert reply.json()["usage"]["completion_tokens"] == 960
    assert elapsed >= ACK_WAIT_S
    faults.spawn()
    assert await stream_is_empty(faults.nats.url)


async def test_sigkill_mid_stream_ends_the_stream_with_worker_lost(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    async with httpx.AsyncClient(base_url=faults.base_url, timeout=120) as client:
        payload = body(900, stream=True)
        before = committed(fleet)
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            chunks = r.aiter_text()
            received = await anext(chunks)
            (name,) = await holders(fleet, 1, faults.workers, before)
            survivors = {
                hb.worker_id: hb.cancelled for hb in fleet.workers() if hb.worker_id != name
            }
            kill(faults.workers.pop(name))
            async for text in chunks:
                received += text
    events = [line[6:] for line in received.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    assert [e["code"] for e in errors] == ["worker_lost"]
    assert 'finish_reason":"length' not in received  # never a second, spliced answer
    # The redelivered attempt was cancelled on the worker that picked it up: not answered twice.
    async with asyncio.timeout(30):
        while not any(  # noqa: ASYNC110 - heartbeats are polled
            hb.cancelled > survivors.get(hb.worker_id, 0)
            for hb in fleet.workers()
            if hb.worker_id in survivors
        ):
            await asyncio.sleep(0.1)
    faults.spawn()
    assert await stream_is_empty(faults.nats.url)
