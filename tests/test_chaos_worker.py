"""A worker killed (SIGKILL) or stopped (SIGTERM) under mixed load (issue 14's chaos suite).
Real processes: the front door, NATS and a Redis of the test's own; two workers on the
simulated engine: the stack's own, in-process, which survives, and a second one in a process of
its own (``python -m tests.simworker``: ``kvgate worker`` runs vLLM only), which is signalled.
A real process, not a cancelled task: SIGKILL leaves its TCP connection to be found dead by the
server, its calls unacknowledged and its heartbeat in the bucket, as a lost machine would.

What an operator relies on (the single faults on vLLM are tests/test_faults.py's; these are
the same faults with the load and the accounting around them):

- SIGKILL: the calls the worker held come back after the ack wait and are served by the other
  worker; a caller whose stream had begun is told ``worker_lost``, any other gets its answer;
  nothing is lost or answered twice, and everything is back to zero.
- SIGTERM: the worker drains: it takes no more calls, hands back those it had staged, lets its
  running calls finish, and exits 0; no caller is told ``worker_lost``, nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from broker.settings import StreamSettings
from schemas.wire import WorkerHeartbeat
from tests.chaos import (
    ChaosStack,
    Kind,
    MixedLoad,
    chaos_stack,
    check_answers,
    check_batch,
    summary,
    wait_for_zero,
)
from tests.polling import poll_until
from tests.servers import RedisServer
from tests.simworker import start_sim_worker

VICTIM = "sim-victim"
ACK_WAIT_S = 4.0
"""The consumers' ack wait here: a killed worker's calls come back after it (30 s by default)."""
WARMUP_S = 4.0
AFTER_S = ACK_WAIT_S + 6.0
"""Load after the fault: the killed worker's calls come back and are served meanwhile."""
START_BOUND_S = 30.0
"""For the worker process to start and heartbeat: a Python start-up on a loaded machine."""
BUSY_BOUND_S = 20.0
"""For the load to give the worker process calls to hold (it shares each tier with the other)."""
DRAIN_GRACE_S = 20.0
"""The drained worker's grace: far longer than any call here runs, so all of them finish."""
EXIT_BOUND_S = DRAIN_GRACE_S + 15.0
KILL_SLACK = 4
"""Calls a killed worker may take and end in the moment between the heartbeat the test saw
and the kill (the test kills at once on seeing it, the heartbeat comes every 0.3 s)."""
STREAM_ENV = {"KVGATE_STREAM_ACK_WAIT_S": str(ACK_WAIT_S)}


@pytest.fixture
async def stack(
    tmp_path: Path, nats_server: EmbeddedNats, redis_server: RedisServer
) -> AsyncIterator[ChaosStack]:
    async with chaos_stack(
        tmp_path,
        nats_server.url,
        redis_url=redis_server.url,
        worker={"stream": StreamSettings(ack_wait_s=ACK_WAIT_S)},
        **STREAM_ENV,
    ) as stack:
        yield stack


@pytest.fixture
async def victim(stack: ChaosStack, tmp_path: Path) -> AsyncIterator[tuple[Proc, Path]]:
    """The second worker, a process of its own, serving beside the stack's; its process and
    where it writes its final counters."""
    proc, counters = start_sim_worker(
        stack.nats_url,
        tmp_path,
        VICTIM,
        KVGATE_WORKER_HEARTBEAT_INTERVAL_S="0.3",
        KVGATE_WORKER_PULL_EXPIRES_S="2",
        KVGATE_WORKER_DRAIN_GRACE_S=str(DRAIN_GRACE_S),
        **STREAM_ENV,
    )
    try:
        await stack.fleet.wait_for(2, START_BOUND_S)
        yield proc, counters
    finally:
        proc.stop()


async def under_load(stack: ChaosStack) -> MixedLoad:
    """The load, started and warmed up: every lane has calls in flight."""
    load = stack.load()
    await load.start()
    await load.run_for(WARMUP_S)
    return load


async def victim_beat(
    stack: ChaosStack, done: Callable[[WorkerHeartbeat], bool]
) -> WorkerHeartbeat:
    """The victim's first heartbeat sent from now on for which ``done`` holds."""
    since_ms = int(time.time() * 1000)

    def seen(live: list[WorkerHeartbeat]) -> bool:
        return any(hb.worker_id == VICTIM and hb.sent_ms > since_ms and done(hb) for hb in live)

    live = await stack.fleet.until(seen, BUSY_BOUND_S)
    return next(hb for hb in live if hb.worker_id == VICTIM)


async def test_a_worker_killed_mid_load_has_its_calls_served_by_the_other(
    stack: ChaosStack, victim: tuple[Proc, Path]
) -> None:
    proc, _ = victim
    load = await under_load(stack)
    # Killed at once on a fresh heartbeat that shows it holding calls: what it ended is known
    # but for the moment since.
    last = await victim_beat(stack, lambda hb: hb.num_running + hb.staged > 0)
    proc.signal(signal.SIGKILL)
    killed_s = time.monotonic()
    held = last.num_running + last.staged + last.num_waiting
    await load.run_for(AFTER_S)
    await load.stop()
    print(
        f"\nworker SIGKILL: it held {held} calls; {summary(load.outcomes)}",
    )
    assert proc.wait(10) == -signal.SIGKILL
    assert check_answers(load.outcomes) == []
    await check_batch(load)
    stack.rest.gone_ended = (last.ended, last.ended + held + KILL_SLACK)
    settled_s, readings = await wait_for_zero(stack.rest)
    print(f"back to zero after {settled_s:.2f} s")
    after = [o for o in load.outcomes if o.started_s > killed_s and o.ok]
    assert {o.kind for o in after} >= {Kind.SESSION_CALL, Kind.PLAIN_CALL}, summary(after)
    assert readings["workers_live"] == 1


async def test_a_worker_stopped_mid_load_drains_and_loses_no_call(
    stack: ChaosStack, victim: tuple[Proc, Path]
) -> None:
    proc, counters_file = victim
    load = await under_load(stack)
    await victim_beat(stack, lambda hb: hb.num_running > 0)
    proc.signal(signal.SIGTERM)
    stopped_s = time.monotonic()
    exited = await poll_until(
        lambda: asyncio.sleep(0, proc.returncode),
        lambda code: code is not None,
        timeout_s=EXIT_BOUND_S,
        interval_s=0.1,
    )
    drained_s = time.monotonic() - stopped_s
    await load.run_for(max(AFTER_S - drained_s, 0.0))
    await load.stop()
    counters = json.loads(counters_file.read_text())
    print(f"\nworker SIGTERM: drained in {drained_s:.2f} s, {counters}\n{summary(load.outcomes)}")
    assert exited == 0, proc.tail()
    assert check_answers(load.outcomes) == []
    assert not [o for o in load.outcomes if o.code == "worker_lost"], summary(load.outcomes)
    # Every call it started ran to its end (none handed back from the engine); the staged
    # ones went back to the stream, and the other worker ended them.
    assert counters["started"] == counters["completed"] + counters["cancelled"], counters
    assert counters["failed"] == counters["faulted"] == 0, counters
    await check_batch(load)
    stack.rest.gone_ended = (counters["ended"], counters["ended"])
    settled_s, readings = await wait_for_zero(stack.rest)
    print(f"back to zero after {settled_s:.2f} s")
    assert readings["workers_live"] == 1
