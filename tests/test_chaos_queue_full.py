"""The calls stream full (issue 14's chaos suite: "disk-full or stream-full JetStream"). Real
processes: the front door, NATS and a Redis of the test's own; the calls stream limited to a
few messages (``KVGATE_STREAM_MAX_MSGS``, discard-new), and no worker pulling at first: a
stand-in heartbeat gives admission a fleet to admit against, as a worker that has not started
pulling yet (or has hung) would.

What an operator relies on: once the stream is full, a further call is refused at once, ``503
queue_full`` with ``Retry-After``, and nothing of it is left behind: no message in the stream,
no one-call session, no call slot. The calls that were accepted wait, their callers with them,
and once a worker starts each is answered exactly once; then everything is back to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest

from broker.natsserver import EmbeddedNats
from broker.settings import StreamSettings
from loadtests.heartbeats import idle_heartbeat, put_heartbeat
from schemas.wire import WORKERS_BUCKET
from tests.chaos import (
    API_KEY,
    MODEL,
    Kind,
    LoadShape,
    MixedLoad,
    Outcome,
    Rest,
    check_answers,
    jetstream_holdings,
    redis_reader,
    summary,
    wait_for_zero,
)
from tests.polling import poll_until, wait_ready
from tests.procs import start_api
from tests.sampler import sample_fleet
from tests.servers import RedisServer
from tests.simworker import sim_worker
from tests.tenants import tenant, write_tenants_file
from workers.sim_engine import SimEngine, SimEngineConfig

QUEUE = 6
"""The calls stream's limit, in messages."""
SESSION_CALLS = 4
PLAIN_CALLS = 8
"""Sent at once with the session's calls: more than the stream holds."""
FILL_BOUND_S = 30.0
"""For the stream to fill and the calls beyond it to be refused: each is one publish; generous
for a loaded 2-core machine."""
ANSWER_BOUND_S = 60.0
"""For the accepted calls to be answered once a worker starts: well under a second each on the
simulated engine, generous for a loaded machine."""
STAND_IN = "stand-in"
HEARTBEAT_INTERVAL_S = 0.5


@contextlib.asynccontextmanager
async def stand_in_worker(nats_url: str) -> AsyncIterator[None]:
    """A live, idle worker's heartbeat for ``MODEL``, kept fresh, that never pulls; removed
    when done."""
    nc = await nats.connect(nats_url)
    kv = await nc.jetstream().key_value(WORKERS_BUCKET)
    beat = msgspec.structs.replace(idle_heartbeat(STAND_IN, capacity=8192), model=MODEL)

    async def beating() -> None:
        while True:
            await put_heartbeat(kv, msgspec.structs.replace(beat, sent_ms=int(time.time() * 1000)))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    task = asyncio.create_task(beating())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kv.delete(STAND_IN)
        await nc.close()


async def stream_messages(nats_url: str) -> int:
    return (await jetstream_holdings(nats_url))["js_calls_pending"]


async def open_session(load: MixedLoad, tier: str) -> str:
    async with load.client() as client:
        # Room for every call the test sends in it at once: none waits for a call slot.
        calls = SESSION_CALLS + 1
        body = {"tier": tier, "max_parallel": calls, "expected_calls": calls}
        resp = await client.post("/v1/sessions", json=body)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


async def close_session(load: MixedLoad, session_id: str) -> None:
    async with load.client() as client:
        resp = await client.delete(f"/v1/sessions/{session_id}")
    assert resp.status_code == 200, resp.text


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    return write_tenants_file(tmp_path, tenant("chaos", API_KEY, max_tier="guaranteed"))


async def test_a_full_calls_stream_refuses_with_queue_full_and_leaves_nothing_behind(
    tmp_path: Path, tenants: Path, nats_server: EmbeddedNats, redis_server: RedisServer
) -> None:
    proc, base = start_api(
        nats_server.url,
        tmp_path,
        KVGATE_TENANTS_FILE=str(tenants),
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_REDIS_URL=redis_server.url,
        KVGATE_DATABASE_URL=f"sqlite:///{tmp_path}/kvgate.db",
        KVGATE_STREAM_MAX_MSGS=str(QUEUE),
    )
    shape = LoadShape(0, 0, 0, 0, batch_sessions=0)
    load = MixedLoad(base, API_KEY, shape)
    try:
        await load.start()  # no lanes: only this test's own calls
        async with stand_in_worker(nats_server.url):
            await wait_ready(base)
            session = await open_session(load, "standard")
            sent = [
                asyncio.create_task(load.call("standard", stream=i % 2 == 0, session_id=session))
                for i in range(SESSION_CALLS)
            ]
            sent += [
                asyncio.create_task(load.call(tier, stream=i % 2 == 0))
                for i, tier in enumerate(["standard", "guaranteed"] * (PLAIN_CALLS // 2))
            ]
            await poll_until(
                lambda: stream_messages(nats_server.url),
                lambda n: n == QUEUE,
                timeout_s=FILL_BOUND_S,
            )

            async def answered_yet() -> list[Outcome]:
                return [t.result() for t in sent if t.done()]

            refused = await poll_until(
                answered_yet, lambda done: len(done) == len(sent) - QUEUE, timeout_s=FILL_BOUND_S
            )
            # The stream is full: further calls, plain or in the session, are refused too.
            refused += [
                await load.call("guaranteed", stream=True),
                await load.call("standard", stream=False, session_id=session),
            ]
            assert all(
                o.status == 503 and o.code == "queue_full" and o.retry_after for o in refused
            ), summary(refused)
            accepted = [t for t in sent if not t.done()]
            assert len(accepted) == QUEUE
            # Nothing of a refused call is held: one lease for the session and one for each
            # accepted plain call (its one-call session), one call slot for each accepted call.
            plain_refused = sum(1 for o in refused if o.kind is Kind.PLAIN_CALL)
            accepted_plain = PLAIN_CALLS + 1 - plain_refused
            async with redis_reader(redis_server.url) as holdings:
                held = await poll_until(
                    holdings.read,
                    lambda h: (
                        h["redis_call_slots"] == QUEUE and h["redis_leases"] == 1 + accepted_plain
                    ),
                    timeout_s=FILL_BOUND_S,
                )
            assert (await jetstream_holdings(nats_server.url))["js_calls_published"] == QUEUE
        # The stand-in is gone; a worker starts, on the same stream layout.
        engine = SimEngine(SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192))
        stream = StreamSettings(max_msgs=QUEUE)
        async with (
            sim_worker(engine, nats_server.url, "sim-late", ready_at=base, stream=stream),
            sample_fleet(nats_server.url) as fleet,
        ):
            started = time.monotonic()
            answered: list[Outcome] = await asyncio.wait_for(
                asyncio.gather(*accepted), ANSWER_BOUND_S
            )
            answered_s = time.monotonic() - started
            await close_session(load, session)
            settled_s, readings = await wait_for_zero(
                Rest(base, nats_server.url, fleet, redis_server.url)
            )
    finally:
        await load.stop()
        proc.stop()
    print(
        f"\nstream full: held {held}; the {QUEUE} accepted calls answered "
        f"{answered_s:.2f} s after the worker started; back to zero after {settled_s:.2f} s"
        f"\n{summary(load.outcomes)}"
    )
    assert all(o.ok for o in answered), summary(answered)
    assert check_answers(load.outcomes) == []
    # Every call in the stream was one an accepted caller waited for: nothing half-published.
    assert readings["js_calls_published"] == QUEUE
