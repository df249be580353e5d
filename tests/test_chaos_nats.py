"""NATS, the calls' queue and the fleet's heartbeats, restarted under mixed load (issue 14's
chaos suite). Real processes: the front door, a NATS server with a file store and a Redis of
the test's own; one in-process worker on the simulated engine.

What an operator relies on when the NATS server restarts on the same port and store:

- calls already in the stream survive the restart and are served after it, their callers
  still waiting for them;
- every caller in flight gets its answer or a clear error (``broker_unavailable`` while the
  server is away), never a hang past its deadline;
- the front door and the worker reconnect on their own: ``/readyz`` answers 503 while the
  server is away and 200 again after, and the fleet view shows the worker again;
- once the load stops, everything is back to zero (tests/chaos.py's accounting).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from broker.natsserver import EmbeddedNats
from schemas.vocab import Tier
from schemas.wire import STREAM_NAME, consumer_name
from tests.chaos import (
    MODEL,
    ChaosStack,
    Kind,
    LoadShape,
    chaos_stack,
    check_answers,
    check_batch,
    may_have_expired,
    readyz,
    summary,
    time_until_answered,
    wait_for_zero,
)
from tests.polling import poll_until
from tests.servers import RedisServer

WARMUP_S = 4.0
AFTER_S = 4.0
DOWN_S = 3.0
"""How long the server stays away: long enough for calls to be refused and /readyz to turn."""
DEADLINE_S = 30
"""The front door's default deadline here: every call is started within it or told
``deadline_exceeded``; the calls parked in the stream over the restart wait well within it."""
IDLE_TIMEOUT_S = 10
"""The longest a started call's worker may stay silent: a reply lost in the restart ends its
call with ``worker_lost`` after this, not after the default minute."""
HANG_BOUND_S = DEADLINE_S + IDLE_TIMEOUT_S + 10
"""No caller waits longer than its deadline plus one silence, with a loaded machine's slack."""
NOT_READY_BOUND_S = 15.0
"""For /readyz to answer 503 once the server is gone: its checks fail at once (NATS
disconnected), the margin is a loaded machine's."""
RECOVERY_BOUND_S = 60.0
"""For /readyz and a call to succeed again once the server is back: the clients' reconnect
back-off (2 s at most), a heartbeat put into the bucket made anew, generous for a loaded
2-core machine."""
PARKED = 4
"""Calls queued on a paused consumer over the restart: they are in the stream when it stops."""


@pytest.fixture
async def stack(
    tmp_path: Path, nats_server: EmbeddedNats, redis_server: RedisServer
) -> AsyncIterator[ChaosStack]:
    async with chaos_stack(
        tmp_path,
        nats_server.url,
        redis_url=redis_server.url,
        KVGATE_DEFAULT_DEADLINE_S=str(DEADLINE_S),
        KVGATE_STREAM_IDLE_TIMEOUT_S=str(IDLE_TIMEOUT_S),
    ) as stack:
        yield stack


async def pending(nats_url: str, tier: Tier) -> int:
    """Calls in the stream that ``tier``'s consumer has not delivered yet."""
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info(STREAM_NAME, consumer_name(tier, MODEL))
        return int(info.num_pending or 0)
    finally:
        await nc.close()


async def set_paused(nats_url: str, tier: Tier, paused: bool) -> None:
    """Pause (or resume) ``tier``'s consumer: the server holds its calls in the stream and
    delivers none to the workers' pull requests."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        name = consumer_name(tier, MODEL)
        if paused:
            await js.pause_consumer(STREAM_NAME, name, "2999-01-01T00:00:00Z")
        else:
            await js.resume_consumer(STREAM_NAME, name)
    finally:
        await nc.close()


async def test_a_nats_restart_mid_load_keeps_queued_calls_and_every_caller_answered(
    stack: ChaosStack, nats_server: EmbeddedNats
) -> None:
    # Best effort is the parked calls' alone: no lane of the load uses it, and the load's batch
    # (best effort by default) runs at standard here, so that none of its lines joins them.
    load = stack.load(LoadShape(batch_tier=Tier.STANDARD.value))
    await load.start()
    await load.run_for(WARMUP_S)
    # Calls that are in the stream when the server stops, their callers waiting.
    await set_paused(stack.nats_url, Tier.BESTEFFORT, True)
    parked = [
        asyncio.create_task(load.call("besteffort", stream=i % 2 == 0)) for i in range(PARKED)
    ]
    await poll_until(
        lambda: pending(stack.nats_url, Tier.BESTEFFORT),
        lambda n: n == PARKED,
        timeout_s=NOT_READY_BOUND_S,
    )

    nats_server.stop()
    down_s = time.monotonic()
    await poll_until(
        lambda: readyz(stack.base_url), lambda s: s == 503, timeout_s=NOT_READY_BOUND_S
    )
    not_ready_s = time.monotonic() - down_s
    await load.run_for(max(DOWN_S - not_ready_s, 0.0))
    nats_server.requested_port = int(stack.nats_url.rsplit(":", 1)[1])
    nats_server.start()
    up_s = time.monotonic()
    answered, _ = await asyncio.gather(
        time_until_answered(load, timeout_s=RECOVERY_BOUND_S),
        poll_until(lambda: readyz(stack.base_url), lambda s: s == 200, timeout_s=RECOVERY_BOUND_S),
    )
    ready_s = time.monotonic() - up_s
    # The parked calls survived the restart: still in the stream, then served.
    assert await pending(stack.nats_url, Tier.BESTEFFORT) == PARKED
    await set_paused(stack.nats_url, Tier.BESTEFFORT, False)
    served = await asyncio.gather(*parked)
    await load.run_for(AFTER_S)
    await load.stop()
    print(
        f"\nnats restart: /readyz 503 {not_ready_s:.2f} s after the stop; after the start, "
        f"first call answered {answered:.2f} s, /readyz 200 {ready_s:.2f} s"
        f"\n{summary(load.outcomes)}"
    )
    assert all(o.ok for o in served), served
    assert check_answers(load.outcomes) == []
    slowest = max(load.outcomes, key=lambda o: o.ended_s - o.started_s)
    assert slowest.ended_s - slowest.started_s < HANG_BOUND_S, slowest
    await check_batch(load)
    stack.rest.may_expire = may_have_expired(load.outcomes)
    settled_s, readings = await wait_for_zero(stack.rest)
    print(f"back to zero after {settled_s:.2f} s")
    # Served after the restart by the worker that reconnected, sessions and plain calls.
    after = [o for o in load.outcomes if o.started_s >= up_s + ready_s and o.ok]
    assert {o.kind for o in after} >= {Kind.SESSION_CALL, Kind.PLAIN_CALL}, summary(after)
    assert readings["js_calls_published"] > 0
