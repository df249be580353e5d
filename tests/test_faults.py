"""Worker faults with real processes: two vLLM CPU workers, a short ack wait (3 s), SIGKILL
mid-generation and SIGTERM drains. No call may be lost or answered twice."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from schemas.wire import STREAM_NAME, TokenDelta, WorkerHeartbeat, decode_event
from tests.calls import chat_body
from tests.polling import poll_until
from tests.procs import start_api, start_worker
from tests.sampler import FleetSampler, sample_fleet

ACK_WAIT_S = 3
STREAM_ENV = {"KVGATE_STREAM_ACK_WAIT_S": str(ACK_WAIT_S)}

CLIENT_TIMEOUT_S = 120
"""A call of up to 960 tokens, redelivered once after the ack wait, on engines sharing two
cores: far more than it takes, bounded only so that a lost call fails the test."""
WORKERS_READY_BOUND_S = 240
"""Two vLLM CPU workers starting side by side on two cores (~30 s each alone)."""
SURVIVOR_CANCEL_BOUND_S = 30
"""For a survivor's heartbeat (every 0.2 s) to show the redelivered attempt it cancelled."""
KILLED_EXIT_BOUND_S = 60
"""How long a process SIGKILLed may take to be gone. It is reaped at once on an idle machine;
on the loaded 2-core CI host a front door killed mid-stream once took longer than 10 s."""
ORPHANS = 24
"""Streamed calls in flight through a front door that is then killed: two of 900 tokens fit in
each worker's cache at a time, so most are still queued when it dies."""
ORPHANS_END_BOUND_S = 120
"""For every call of the killed front door to have ended at the workers. Run to their last
token two at a time per worker they would take longer than the assertions allow anyway."""


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
        # Heartbeats every 0.2 s: a test sees a new worker, and a survivor's counters move,
        # without waiting long.
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
        yield stack
    finally:
        stack.close()


@pytest.fixture
async def fleet(faults: FaultStack) -> AsyncIterator[FleetSampler]:
    """Two serving workers, replacing any an earlier test stopped (ready in ~30 s)."""
    while len(faults.workers) < 2:
        faults.spawn()
    async with sample_fleet(faults.nats.url, workers=2, timeout=WORKERS_READY_BOUND_S) as sampler:
        yield sampler


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return chat_body("write the plan", max_tokens, **extra)


class FirstTokens:
    """Watches every reply inbox on the stack's NATS (core NATS fans a message out to every
    subscriber, so the front door still gets each event) and yields the worker named by each
    attempt's first token: the worker running that attempt, known the moment it starts, with
    no heartbeat delay in between."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._seen: asyncio.Queue[str] = asyncio.Queue()

    async def __aenter__(self) -> FirstTokens:
        self._nc = await nats.connect(self._url)
        await self._nc.subscribe("_INBOX.>", cb=self._on_event)
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._nc.close()

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # another inbox's traffic (JetStream API replies)
        if isinstance(event, TokenDelta) and event.worker_id:
            self._seen.put_nowait(event.worker_id)

    async def next_worker(self, timeout: float = 60) -> str:
        async with asyncio.timeout(timeout):
            return await self._seen.get()


def kill(proc: Proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the worker and its engine core process
    proc.wait(KILLED_EXIT_BOUND_S)
    proc.stop()


async def last_sequence(url: str) -> int:
    """The calls stream's last sequence number: how many calls were ever published to it."""
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(STREAM_NAME)).state.last_seq
    finally:
        await nc.close()


async def stream_is_empty(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(STREAM_NAME)).state.messages == 0
    finally:
        await nc.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
async def test_a_stop_signal_finishes_running_calls_and_exits_zero(
    faults: FaultStack, fleet: FleetSampler, sig: signal.Signals
) -> None:
    async with (
        httpx.AsyncClient(base_url=faults.base_url, timeout=CLIENT_TIMEOUT_S) as client,
        FirstTokens(faults.nats.url) as first_tokens,
    ):
        calls = [
            asyncio.create_task(client.post("/v1/chat/completions", json=body(400)))
            for _ in range(3)
        ]
        # Stop the first worker to start one of the calls, while that call runs.
        name = await first_tokens.next_worker()
        worker = faults.workers[name]
        worker.signal(sig)
        # The draining worker takes no new work: a call sent now is served by the other one.
        after = await client.post("/v1/chat/completions", json=body(20))
        replies = await asyncio.gather(*calls)
        assert worker.wait(timeout=40) == 0, worker.tail()
    assert after.status_code == 200
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 400
    faults.workers.pop(name).stop()
    assert await stream_is_empty(faults.nats.url)


async def test_sigkill_mid_generation_redelivers_a_non_streamed_call(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    async with (
        httpx.AsyncClient(base_url=faults.base_url, timeout=CLIENT_TIMEOUT_S) as client,
        FirstTokens(faults.nats.url) as first_tokens,
    ):
        started = time.monotonic()
        call = asyncio.create_task(client.post("/v1/chat/completions", json=body(960)))
        name = await first_tokens.next_worker()
        kill(faults.workers.pop(name))
        reply = await call
        elapsed = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvgate-worker"] != name
    # One complete answer, from the worker the call was redelivered to after the ack wait.
    assert reply.json()["usage"]["completion_tokens"] == 960
    assert elapsed >= ACK_WAIT_S
    assert await stream_is_empty(faults.nats.url)


async def test_sigkill_mid_stream_ends_the_stream_with_worker_lost(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    # Every worker's cancel count before the call, read once the watch shows both (a count
    # read mid-stream can miss a worker whose heartbeat is late on a loaded machine, and a
    # survivor missing from it could never be seen to cancel).
    ready = await fleet.until(lambda live: len(live) >= 2, WORKERS_READY_BOUND_S)
    cancelled_before = {hb.worker_id: hb.cancelled for hb in ready}
    async with httpx.AsyncClient(base_url=faults.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        payload = body(900, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            name = r.headers["x-kvgate-worker"]
            # Kill the worker once the client holds some of its tokens (a 900-token call
            # takes about 1.5 s on this engine, so the kill lands mid-stream).
            received = ""
            chunks = r.aiter_text()
            async for text in chunks:
                received += text
                if '"content":"' in received.replace('"content":""', ""):
                    break
            survivors = {w: n for w, n in cancelled_before.items() if w != name}
            kill(faults.workers.pop(name))
            async for text in chunks:
                received += text
    events = [line[6:] for line in received.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    assert [e["code"] for e in errors] == ["worker_lost"], received[-600:]
    assert 'finish_reason":"length' not in received  # never a second, spliced answer
    # The redelivered attempt was cancelled on the worker that picked it up: not answered twice.
    await fleet.until(
        lambda live: any(
            hb.cancelled > survivors.get(hb.worker_id, 0)
            for hb in live
            if hb.worker_id in survivors
        ),
        SURVIVOR_CANCEL_BOUND_S,
    )
    assert await stream_is_empty(faults.nats.url)


def orphans_left(live: list[WorkerHeartbeat], before: dict[str, WorkerHeartbeat]) -> str:
    """Each worker's calls running and staged, and how many ended each way since ``before``."""
    ways = ("completed", "cancelled", "deadline_dropped", "failed", "faulted", "ended")
    return "; ".join(
        f"{hb.worker_id}: running {hb.num_running}, staged {hb.staged}, "
        + ", ".join(
            f"{way} +{getattr(hb, way) - getattr(before[hb.worker_id], way)}" for way in ways
        )
        for hb in live
        if hb.worker_id in before
    )


async def test_a_killed_front_door_leaves_no_call_running_for_nobody(
    faults: FaultStack, fleet: FleetSampler
) -> None:
    """A front door SIGKILLed mid-stream sends no cancel. The workers ask each call's inbox
    whether its caller still waits (every 2 s from when it was sent) and end the calls nobody
    waits for: most never run to their last token, none stays held or queued, and the other
    front door serves on."""
    # Admits every call at once (they queue in JetStream), as a busy front door would have.
    doomed, doomed_url = start_api(
        faults.nats.url,
        faults.root,
        KVGATE_ADMISSION_KV_OVERCOMMIT="50",
        KVGATE_ADMISSION_KV_OVERCOMMIT_MAX="50",
        **STREAM_ENV,
    )
    # Read once the watch has caught up: start_api blocks this loop for as long as a front door
    # takes to start, and the heartbeats seen before it can be stale by then (an empty
    # ``before`` made the wait below run to its bound on a slow machine).
    ready = await fleet.until(lambda live: len(live) >= 2, WORKERS_READY_BOUND_S)
    before = {hb.worker_id: hb for hb in ready}
    published_before = await last_sequence(faults.nats.url)
    first_token = asyncio.Event()

    async def stream_one(client: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the connection dies with the front door
            payload = body(900, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
                async for text in r.aiter_text():
                    if '"content":"' in text.replace('"content":""', ""):
                        first_token.set()

    async def published() -> int:
        return await last_sequence(faults.nats.url) - published_before

    async with httpx.AsyncClient(base_url=doomed_url, timeout=CLIENT_TIMEOUT_S) as client:
        streams = [asyncio.create_task(stream_one(client)) for _ in range(ORPHANS)]
        # Every call admitted and queued, and tokens flowing: then the front door dies.
        await poll_until(published, lambda n: n >= ORPHANS, timeout_s=CLIENT_TIMEOUT_S)
        await asyncio.wait_for(first_token.wait(), CLIENT_TIMEOUT_S)
        kill(doomed)
        await asyncio.gather(*streams)
    admitted = ORPHANS

    def ended(live: list[WorkerHeartbeat]) -> int:
        return sum(
            hb.completed
            + hb.cancelled
            - before[hb.worker_id].completed
            - before[hb.worker_id].cancelled
            for hb in live
            if hb.worker_id in before
        )

    try:
        live = await fleet.until(
            lambda live: (
                ended(live) >= admitted
                and all(hb.num_running == 0 and hb.staged == 0 for hb in live)
            ),
            ORPHANS_END_BOUND_S,
        )
    except TimeoutError:  # say which calls were left, and how the others ended
        pytest.fail(
            f"{admitted} orphans not all ended: {orphans_left(fleet.workers(), before)} "
            f"(workers before: {sorted(before)})"
        )
    cancelled = sum(hb.cancelled - before[hb.worker_id].cancelled for hb in live)
    assert ended(live) == admitted  # each ended once
    assert cancelled >= admitted // 2, cancelled  # most never ran to their last token
    assert await stream_is_empty(faults.nats.url)
    async with httpx.AsyncClient(base_url=faults.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        after = await client.post("/v1/chat/completions", json=body(20))
    assert after.status_code == 200, after.text
