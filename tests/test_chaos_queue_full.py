"""The calls stream full, and the disk under JetStream full (issue 14's chaos suite: "disk-full
or stream-full JetStream"). Real processes: the front door, NATS and a Redis of the test's own;
the calls stream limited to a few messages (``KVGATE_STREAM_MAX_MSGS``, discard-new), or the
server's disk taken by another stream, and no worker pulling at first: a stand-in heartbeat
gives admission a fleet to admit against, as a worker that has not started pulling yet (or has
hung) would.

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
from nats.js.errors import APIError

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
    chaos_front_door,
    check_answers,
    jetstream_holdings,
    redis_reader,
    summary,
    wait_for_zero,
)
from tests.polling import poll_until, wait_ready
from tests.sampler import sample_fleet
from tests.servers import RedisServer
from tests.simworker import sim_worker
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


async def serve_and_settle(
    load: MixedLoad,
    session: str,
    accepted: list[asyncio.Task[Outcome]],
    nats_url: str,
    redis_server: RedisServer,
    stream: StreamSettings,
) -> tuple[list[Outcome], float, float, dict[str, int]]:
    """A worker starts on ``stream``'s layout and answers the ``accepted`` calls; the
    session is closed and everything comes back to zero. Returns the answers, the seconds
    they took, the seconds to zero and the readings then."""
    engine = SimEngine(SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192))
    async with (
        sim_worker(engine, nats_url, "sim-late", ready_at=load.base_url, stream=stream),
        sample_fleet(nats_url) as fleet,
    ):
        started = time.monotonic()
        answered = await asyncio.wait_for(asyncio.gather(*accepted), ANSWER_BOUND_S)
        answered_s = time.monotonic() - started
        await close_session(load, session)
        settled_s, readings = await wait_for_zero(
            Rest(load.base_url, nats_url, fleet, redis_server.url)
        )
    return answered, answered_s, settled_s, readings


async def test_a_full_calls_stream_refuses_with_queue_full_and_leaves_nothing_behind(
    tmp_path: Path, nats_server: EmbeddedNats, redis_server: RedisServer
) -> None:
    api = contextlib.ExitStack()
    _, base = api.enter_context(
        chaos_front_door(
            tmp_path, nats_server.url, redis_server.url, KVGATE_STREAM_MAX_MSGS=str(QUEUE)
        )
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
        answered, answered_s, settled_s, readings = await serve_and_settle(
            load, session, accepted, nats_server.url, redis_server, StreamSettings(max_msgs=QUEUE)
        )
    finally:
        await load.stop()
        api.close()
    print(
        f"\nstream full: held {held}; the {QUEUE} accepted calls answered "
        f"{answered_s:.2f} s after the worker started; back to zero after {settled_s:.2f} s"
        f"\n{summary(load.outcomes)}"
    )
    assert all(o.ok for o in answered), summary(answered)
    assert check_answers(load.outcomes) == []
    # Every call in the stream was one an accepted caller waited for: nothing half-published.
    assert readings["js_calls_published"] == QUEUE


STORE_LIMIT = 8 << 20
"""The disk the test's NATS server lets JetStream use: room for both of kvgate's streams'
``max_bytes`` (1 MiB each here) besides what fills it."""
STREAM_MAX_BYTES = 1 << 20
INSUFFICIENT_RESOURCES = 10023
"""The server's ``err_code`` once its JetStream storage is used up: its limit, or a full disk
(both seen: ``max_file_store``, and a 1 MiB tmpfs under the store)."""
BALLAST = "BALLAST"


async def fill_the_disk(nats_url: str) -> int:
    """Another stream takes all the disk the server allows, 16 KiB a message, until the
    server refuses one; returns the bytes it took."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=BALLAST, subjects=["ballast.>"])
        for taken in range(0, 4 * STORE_LIMIT, 16 << 10):
            try:
                await js.publish("ballast.x", bytes(16 << 10), stream=BALLAST)
            except APIError as exc:
                if exc.err_code != INSUFFICIENT_RESOURCES:
                    raise
                return taken
        raise AssertionError("the server never ran out of disk")
    finally:
        await nc.close()


async def free_the_disk(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().delete_stream(BALLAST)
    finally:
        await nc.close()


async def test_a_full_disk_refuses_calls_with_queue_full_until_it_is_freed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    server = EmbeddedNats(
        tmp_path / "nats", log_file=tmp_path / "nats.log", max_store_bytes=STORE_LIMIT
    ).start()
    api = contextlib.ExitStack()
    _, base = api.enter_context(
        chaos_front_door(
            tmp_path, server.url, redis_server.url, KVGATE_STREAM_MAX_BYTES=str(STREAM_MAX_BYTES)
        )
    )
    load = MixedLoad(base, API_KEY, LoadShape(0, 0, 0, 0, batch_sessions=0))
    try:
        await load.start()
        async with stand_in_worker(server.url):
            await wait_ready(base)
            session = await open_session(load, "standard")
            taken = await fill_the_disk(server.url)
            # Each refused at once, in a session or not, streamed or not: nothing is queued.
            refused = await asyncio.gather(
                *(load.call("standard", stream=s, session_id=session) for s in (True, False)),
                *(
                    load.call(tier, stream=s)
                    for tier in ("guaranteed", "standard")
                    for s in (True, False)
                ),
            )
            assert all(
                o.status == 503 and o.code == "queue_full" and o.retry_after for o in refused
            ), summary(refused)
            assert await stream_messages(server.url) == 0
            # Nothing of them is held: the session's lease alone, and no call slot.
            async with redis_reader(redis_server.url) as holdings:
                held = await poll_until(
                    holdings.read,
                    lambda h: h["redis_call_slots"] == 0 and h["redis_leases"] == 1,
                    timeout_s=FILL_BOUND_S,
                )
            # The operator frees the disk: calls are accepted again.
            await free_the_disk(server.url)
            accepted = [
                asyncio.create_task(load.call("standard", stream=i % 2 == 0, session_id=session))
                for i in range(SESSION_CALLS)
            ]
            await poll_until(
                lambda: stream_messages(server.url),
                lambda n: n == SESSION_CALLS,
                timeout_s=FILL_BOUND_S,
            )
        answered, _, settled_s, readings = await serve_and_settle(
            load,
            session,
            accepted,
            server.url,
            redis_server,
            StreamSettings(max_bytes=STREAM_MAX_BYTES),
        )
    finally:
        await load.stop()
        api.close()
        server.stop()
    print(
        f"\ndisk full: the ballast took {taken / (1 << 20):.1f} MiB; held {held} while full; "
        f"back to zero {settled_s:.2f} s after the disk was freed\n{summary(load.outcomes)}"
    )
    assert all(o.ok for o in answered), summary(answered)
    assert check_answers(load.outcomes) == []
    assert readings["js_calls_published"] == SESSION_CALLS
