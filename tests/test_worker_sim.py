"""The worker shell on a real NATS server, driving the simulated engine adapter: the fault paths
a real engine cannot be made to take on purpose, and the headroom invariant at speed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError as KeyValueNotFoundError
from nats.js.errors import NotFoundError

import workers.worker as worker_module
from broker.natsserver import EmbeddedNats
from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls, workers_bucket
from schemas.vocab import ErrorCode, Tier
from schemas.wire import (
    STREAM_NAME,
    CallEnvelope,
    Done,
    Failed,
    TokenDelta,
    WorkerHeartbeat,
    call_subject,
    consumer_name,
    decode_event,
    decode_heartbeat,
    encode,
)
from tests.calls import make_call
from tests.polling import poll_until
from workers.engine import (
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PreparedRequest,
)
from workers.settings import HeadroomSettings, WorkerSettings
from workers.sim_engine import FAIL_MARKER, SimEngine, SimEngineConfig
from workers.worker import Worker

STREAM = StreamSettings(ack_wait_s=2, max_deliver=3)
MODEL = "kvgate-sim"

EVENT_BOUND_S = 30.0
"""For an event that is due (a call's end, a worker's drain, its pull requests at the server):
generous for a loaded 2-core machine, and still half the 60 s a pull request left open would
keep a tier waiting (test_a_call_refused_on_arrival_does_not_hold_up_the_next)."""
CANCEL_BOUND_S = 2.0
"""How soon a cancel ends a running call that has 10 s of tokens left."""
QUIET_WINDOW_S = 0.5
"""How long a call is watched after its terminal event, in which nothing may follow it (a
redelivery after a NAK would come 0.2 s later)."""
PROBE_INTERVAL_S = 0.2
"""How often the worker asks whether a call's caller still waits, in the tests that kill one."""
ORPHAN_BOUND_S = 10.0
"""For a call whose caller is gone to be ended: probes every 0.2 s, so generous for a loaded
machine, and still well under the 15 s the test's calls would otherwise run."""
SAMPLE_INTERVAL_S = 0.01
"""How often a test samples the engine's KV usage: once a step (10 ms on the simulated engine)."""


@dataclass
class Inbox:
    events: list[TokenDelta | Done | Failed] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_msg(self, msg: Msg) -> None:
        event = decode_event(msg.data)
        self.events.append(event)
        self.started.set()
        if isinstance(event, Done | Failed):
            self.ended.set()

    @property
    def terminal(self) -> Done | Failed:
        last = self.events[-1]
        assert isinstance(last, Done | Failed)
        return last


def call(
    call_id: str,
    *,
    tier: Tier = Tier.STANDARD,
    content: str = "a b c",
    max_tokens: int = 8,
    deadline_in_s: float = 30,
) -> CallEnvelope:
    """A streamed call, a session of its own, for the simulated engine."""
    return make_call(
        call_id,
        tier=tier,
        deadline_in_s=deadline_in_s,
        model=MODEL,
        session_id=call_id,
        content=content,
        max_tokens=max_tokens,
        stream=True,
    )


class Harness:
    def __init__(self, nc: NATS, url: str) -> None:
        self.nc = nc
        self.url = url
        self.js = nc.jetstream()
        self.publisher = CallPublisher(self.js)
        self.workers: list[tuple[Worker, asyncio.Task[None]]] = []

    async def start_worker(
        self,
        config: SimEngineConfig | None = None,
        *,
        engine: SimEngine | None = None,
        **options: object,
    ) -> Worker:
        settings: dict[str, object] = {
            "heartbeat_interval_s": 0.2,
            "pull_expires_s": 2,
            "drain_grace_s": 5,
            "nak_delay_s": 0.2,
            "stream": STREAM,
            **options,
        }
        worker = Worker(
            engine or SimEngine(config),
            WorkerSettings(
                nats_url=self.url,
                worker_id=f"sim-{len(self.workers)}",
                **settings,  # type: ignore[arg-type]
            ),
        )
        task = asyncio.create_task(worker.run())
        self.workers.append((worker, task))
        return worker

    async def send(self, envelope: CallEnvelope) -> Inbox:
        inbox = Inbox()
        subject = f"_INBOX.test.{envelope.call_id}"
        await self.nc.subscribe(subject, cb=inbox.on_msg)
        await self.publisher.publish(envelope, subject, now_ms=envelope.created_ms)
        return inbox

    async def doorbells_open(self) -> None:
        """Until a pull request waits at every tier's consumer: a worker is subscribed (to
        cancels too: it subscribes to them before it asks for calls) and listens on every
        tier."""

        async def waiting() -> list[int]:
            counts = []
            for tier in Tier:
                try:
                    info = await self.js.consumer_info(STREAM_NAME, consumer_name(tier, MODEL))
                except NotFoundError:  # not provisioned by the worker yet
                    counts.append(0)
                else:
                    counts.append(info.num_waiting or 0)
            return counts

        await poll_until(waiting, all, timeout_s=EVENT_BOUND_S, interval_s=0.02)

    async def stop(self) -> None:
        for worker, _ in self.workers:
            worker.request_stop()
        for _, task in self.workers:
            await asyncio.wait_for(task, EVENT_BOUND_S)


@pytest.fixture
async def harness(nats_server: EmbeddedNats, nc: NATS) -> AsyncIterator[Harness]:
    await provision_calls(nc.jetstream(), STREAM)
    h = Harness(nc, nats_server.url)
    try:
        yield h
    finally:
        await h.stop()


async def test_a_call_refused_on_arrival_does_not_hold_up_the_next(harness: Harness) -> None:
    """A call the engine refuses when it arrives (here: too long for the context) used its
    tier's pull credit; the worker must ask for more at once, not when the pull expires."""
    worker = await harness.start_worker(pull_expires_s=60)
    refused = await harness.send(call("too-long", content="w " * 3000))
    await asyncio.wait_for(refused.ended.wait(), EVENT_BOUND_S)
    assert isinstance(refused.terminal, Failed)
    assert refused.terminal.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    # Within EVENT_BOUND_S, half the 60 s the pull request would keep the tier waiting.
    following = await harness.send(call("next", max_tokens=3))
    await asyncio.wait_for(following.ended.wait(), EVENT_BOUND_S)
    assert isinstance(following.terminal, Done)

    async def outcomes() -> tuple[int, int, int]:
        counters = worker.counters
        return counters.ended, counters.failed, counters.completed

    # Each ended for good once; the refusal counts as failed: an error its caller saw.
    await poll_until(outcomes, lambda o: o == (2, 1, 1), timeout_s=EVENT_BOUND_S, interval_s=0.01)


async def test_credit_whose_expiry_notice_was_lost_is_asked_for_again(harness: Harness) -> None:
    """A pull request that ends at the server without its expiry notice reaching the worker
    (lost in a reconnect) must not count as open credit for ever: the tier would never be
    asked for again while the worker reports itself idle."""
    worker = await harness.start_worker(pull_expires_s=1)
    await harness.doorbells_open()
    # Lose the notices: nobody listens on the pull inboxes while the open requests expire.
    # The test reaches into the worker's pullers, as a dropped connection would.
    pullers = list(worker._pullers.values())
    for puller in pullers:
        assert puller._sub is not None
        await puller._sub.unsubscribe()

    async def waiting() -> list[int]:
        infos = [await harness.js.consumer_info(STREAM_NAME, consumer_name(t, MODEL)) for t in Tier]
        return [info.num_waiting or 0 for info in infos]

    await poll_until(waiting, lambda counts: not any(counts), timeout_s=EVENT_BOUND_S)
    for puller in pullers:
        puller._sub = await worker.nc.subscribe(puller._inbox, cb=puller._receive)

    following = await harness.send(call("after-the-loss", max_tokens=3))
    await asyncio.wait_for(following.ended.wait(), EVENT_BOUND_S)
    assert isinstance(following.terminal, Done)


async def test_a_call_whose_front_door_is_gone_is_ended(harness: Harness) -> None:
    """A front door killed mid-call sends no cancel: the worker's probe of the call's inbox
    finds nobody there and ends the call, running or staged, long before its tokens would
    have run out (1,500 tokens at 10 ms a step: 15 s)."""
    worker = await harness.start_worker(
        SimEngineConfig(max_num_seqs=1, step_s=0.01), caller_probe_s=PROBE_INTERVAL_S
    )
    await harness.doorbells_open()
    # Nobody subscribes to these inboxes: the front door that published the calls is gone.
    for call_id in ("orphan-running", "orphan-staged"):
        orphan = call(call_id, max_tokens=1500)
        await harness.publisher.publish(orphan, f"_INBOX.gone.{call_id}", now_ms=orphan.created_ms)

    async def ended() -> tuple[int, int]:
        return worker.counters.cancelled, worker.heartbeat().num_running

    await poll_until(ended, lambda c: c == (2, 0), timeout_s=ORPHAN_BOUND_S, interval_s=0.05)
    assert worker.counters.completed == 0
    # Terminated, not handed back: no other worker will run them for nobody either (the
    # terms are confirmed by the server just after the counters move).

    async def left() -> tuple[int, int]:
        info = await harness.js.consumer_info(STREAM_NAME, consumer_name(Tier.STANDARD, MODEL))
        return int(info.num_ack_pending or 0), int(info.num_pending or 0)

    await poll_until(left, lambda held: held == (0, 0), timeout_s=EVENT_BOUND_S)


async def test_calls_complete_with_one_terminal_event(harness: Harness) -> None:
    await harness.start_worker()
    inboxes = [await harness.send(call(f"c{i}", max_tokens=5)) for i in range(6)]
    for inbox in inboxes:
        await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
        assert isinstance(inbox.terminal, Done)
        assert sum(e.tokens for e in inbox.events if isinstance(e, TokenDelta)) == 5
        assert [e.seq for e in inbox.events] == list(range(len(inbox.events)))


async def test_engine_errors_are_retried_then_reported_once(harness: Harness) -> None:
    worker = await harness.start_worker()
    inbox = await harness.send(call("bad", content=f"x {FAIL_MARKER}"))
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    await asyncio.sleep(QUIET_WINDOW_S)  # nothing may follow the terminal event
    assert len(inbox.events) == 1
    failed = inbox.terminal
    assert isinstance(failed, Failed)
    assert failed.code == ErrorCode.ENGINE_ERROR
    assert failed.attempt == STREAM.max_deliver
    info = await harness.js.stream_info(STREAM_NAME)
    assert info.state.messages == 0  # terminated, not left to redeliver
    # Operators see it in the worker's heartbeat (kvgate workers, the fleet view).
    beat = worker.heartbeat()
    # Ended for good once, after two hand-backs that did not end it.
    assert (beat.failed, beat.faulted, beat.completed, beat.ended) == (1, 0, 0, 1)


async def test_a_call_past_its_deadline_is_never_started(harness: Harness) -> None:
    # Publish a call whose deadline already passed but whose TTL has not: the worker must
    # drop it itself.
    stale = call("stale", deadline_in_s=-1)
    inbox = Inbox()
    await harness.nc.subscribe("_INBOX.test.stale", cb=inbox.on_msg)
    headers = {"Kvgate-Call": "stale", "Kvgate-Reply": "_INBOX.test.stale"}
    await harness.js.publish(
        call_subject(stale.tier, stale.model), encode(stale), headers=headers, msg_ttl=30
    )
    worker = await harness.start_worker()
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    failed = inbox.terminal
    assert isinstance(failed, Failed)
    assert failed.code == ErrorCode.DEADLINE_EXCEEDED
    assert worker.counters.started == 0
    assert worker.counters.deadline_dropped == 1


async def test_a_call_whose_answer_would_go_to_a_calls_queue_is_terminated(
    harness: Harness,
) -> None:
    forged = call("forged", tier=Tier.STANDARD)
    queue = call_subject(Tier.GUARANTEED, forged.model)
    landed: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        landed.append(msg.data)

    await harness.nc.subscribe(queue, cb=on_msg)
    headers = {"Kvgate-Call": "forged", "Kvgate-Reply": queue}
    await harness.js.publish(
        call_subject(forged.tier, forged.model), encode(forged), headers=headers
    )
    worker = await harness.start_worker()
    await poll_until(
        lambda: harness.js.stream_info(STREAM_NAME),
        lambda info: info.state.messages == 0,
        timeout_s=EVENT_BOUND_S,
    )
    await harness.nc.flush()
    assert worker.counters.started == 0 and landed == []


async def test_a_staged_call_whose_deadline_passes_is_dropped(harness: Harness) -> None:
    # One sequence slot, doorbells open on every tier: the second call is delivered but waits
    # staged behind the long first one.
    worker = await harness.start_worker(SimEngineConfig(max_num_seqs=1, step_s=0.01))
    await harness.doorbells_open()
    long = await harness.send(call("long", tier=Tier.GUARANTEED, max_tokens=150))
    short = await harness.send(call("short", deadline_in_s=0.5))
    await asyncio.wait_for(short.ended.wait(), EVENT_BOUND_S)
    assert isinstance(short.terminal, Failed)
    assert short.terminal.code == ErrorCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(long.ended.wait(), EVENT_BOUND_S)
    assert isinstance(long.terminal, Done)
    assert worker.counters.deadline_dropped == 1


async def test_burst_never_commits_past_the_high_water_mark(harness: Harness) -> None:
    config = SimEngineConfig(max_num_seqs=32, kv_capacity_tokens=2048, block_size=16)
    headroom = HeadroomSettings(kv_high_water=0.8, guaranteed_reserve=0)
    worker = await harness.start_worker(config, headroom=headroom)
    # Each call costs ceil((7 + 100) / 16) * 16 = 112 tokens; 3x the cache is ~55 calls.
    inboxes = [await harness.send(call(f"b{i}", max_tokens=100)) for i in range(55)]
    peak_usage = 0.0
    while not all(i.ended.is_set() for i in inboxes):
        peak_usage = max(peak_usage, worker.engine.stats().kv_cache_usage or 0.0)
        await asyncio.sleep(SAMPLE_INTERVAL_S)  # sampling: a peak is no event to await
    assert all(isinstance(i.terminal, Done) for i in inboxes)
    assert worker.counters.max_committed_tokens <= 0.8 * 2048
    assert peak_usage <= 0.8
    # ...and it kept the batch full: within two calls of the mark (the cost estimate that
    # sizes pull requests starts high and converges as calls arrive).
    assert worker.counters.max_committed_tokens >= 0.8 * 2048 - 2 * 112


async def test_guaranteed_calls_overtake_a_besteffort_backlog(harness: Harness) -> None:
    worker = await harness.start_worker(SimEngineConfig(max_num_seqs=2, step_s=0.005))
    backlog = [
        await harness.send(call(f"be{i}", tier=Tier.BESTEFFORT, max_tokens=20)) for i in range(12)
    ]
    # The engine is busy with the backlog when the guaranteed call comes.
    await asyncio.wait_for(backlog[0].started.wait(), EVENT_BOUND_S)
    urgent = await harness.send(call("g", tier=Tier.GUARANTEED, max_tokens=20))
    await asyncio.wait_for(urgent.ended.wait(), EVENT_BOUND_S)
    done_before = sum(1 for b in backlog if b.ended.is_set())
    assert done_before <= 6, done_before  # it did not wait behind the whole backlog
    for b in backlog:
        await asyncio.wait_for(b.ended.wait(), EVENT_BOUND_S)
    assert worker.counters.completed == 13


async def test_cancel_stops_a_running_call(harness: Harness) -> None:
    worker = await harness.start_worker(SimEngineConfig(step_s=0.01))
    inbox = await harness.send(call("long", max_tokens=1000))
    await asyncio.wait_for(inbox.started.wait(), EVENT_BOUND_S)
    await harness.nc.publish("kvgate.cancel.long", b"")
    await asyncio.wait_for(inbox.ended.wait(), CANCEL_BOUND_S)
    assert isinstance(inbox.terminal, Failed)
    assert inbox.terminal.code == ErrorCode.CANCELLED
    assert worker.engine.stats().num_running == 0
    assert worker.counters.cancelled == 1


async def test_drain_finishes_running_calls_and_hands_back_the_rest(harness: Harness) -> None:
    worker = await harness.start_worker(SimEngineConfig(max_num_seqs=1, step_s=0.01))
    first = await harness.send(call("first", max_tokens=30))
    second = await harness.send(call("second", max_tokens=30))
    await asyncio.wait_for(first.started.wait(), EVENT_BOUND_S)
    worker.request_stop()
    await asyncio.wait_for(harness.workers[0][1], EVENT_BOUND_S)
    assert isinstance(first.terminal, Done)
    assert not second.events  # never started here...
    # ...and handed back: a new worker serves it.
    await harness.start_worker()
    await asyncio.wait_for(second.ended.wait(), EVENT_BOUND_S)
    assert isinstance(second.terminal, Done)


class _FirstDiscardWaits(SimEngine):
    """Holds the first ``discard`` until ``release`` is set, so that a test can land something
    in the middle of the worker's drain."""

    def __init__(self, config: SimEngineConfig) -> None:
        super().__init__(config)
        self.discarding = asyncio.Event()
        self.release = asyncio.Event()

    async def discard(self, prepared: PreparedRequest) -> None:
        if not self.discarding.is_set():
            self.discarding.set()
            await self.release.wait()


async def test_a_cancel_that_lands_while_the_drain_hands_a_call_back_ends_it_once(
    harness: Harness,
) -> None:
    # As in the test below: two calls of 416 tokens fit under the mark, the third waits staged.
    config = SimEngineConfig(max_num_seqs=16, kv_capacity_tokens=1024, block_size=16, step_s=0.002)
    engine = _FirstDiscardWaits(config)
    headroom = HeadroomSettings(kv_high_water=0.9, guaranteed_reserve=0.25)
    worker = await harness.start_worker(engine=engine, headroom=headroom)
    sent = {
        name: await harness.send(call(name, tier=Tier.BESTEFFORT, max_tokens=400))
        for name in ("run0", "run1", "queued")
    }
    running = [sent["run0"], sent["run1"]]

    async def staged() -> int:
        return worker.heartbeat().staged

    await poll_until(staged, lambda n: n == 1, timeout_s=EVENT_BOUND_S)
    worker.request_stop()
    await asyncio.wait_for(engine.discarding.wait(), EVENT_BOUND_S)  # handing "queued" back
    await harness.nc.publish("kvgate.cancel.queued", b"")

    async def cancel_seen() -> bool:  # the worker remembers every cancel it received
        return "queued" in worker._cancelled

    await poll_until(cancel_seen, bool, timeout_s=EVENT_BOUND_S)
    engine.release.set()
    await asyncio.wait_for(harness.workers[0][1], EVENT_BOUND_S)  # and the drain ends cleanly
    # Handed back or cancelled, not both: one outcome per call.
    assert worker.counters.handed_back + worker.counters.cancelled == 1
    assert all(isinstance(inbox.terminal, Done) for inbox in running)


async def test_drain_hands_back_a_running_call_that_outlives_the_grace(harness: Harness) -> None:
    worker = await harness.start_worker(SimEngineConfig(step_s=0.01), drain_grace_s=0.3)
    long = await harness.send(call("long", max_tokens=500))
    await asyncio.wait_for(long.started.wait(), EVENT_BOUND_S)
    worker.request_stop()
    await asyncio.wait_for(harness.workers[0][1], EVENT_BOUND_S)
    assert worker.counters.handed_back == 1
    assert not long.ended.is_set()  # no terminal event from the worker that gave it up
    # Redelivered, it completes elsewhere as attempt 2.
    await harness.start_worker(SimEngineConfig(step_s=0.001))
    await asyncio.wait_for(long.ended.wait(), EVENT_BOUND_S)
    assert isinstance(long.terminal, Done)
    assert long.terminal.attempt == 2


class _DeafToAborts(SimEngine):
    """Its requests give one token, then do not end when cancelled (an engine that does not
    answer an abort) until ``release`` is set."""

    def __init__(self, config: SimEngineConfig) -> None:
        super().__init__(config)
        self.release = asyncio.Event()

    async def generate(self, prepared: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        outputs = super().generate(prepared)
        yield await anext(outputs)
        await outputs.aclose()
        while not self.release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.release.wait()


async def test_a_drain_ends_even_when_a_cancelled_call_does_not(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "DRAIN_CANCEL_BOUND_S", 0.5)
    engine = _DeafToAborts(SimEngineConfig(step_s=0.01))
    worker = await harness.start_worker(engine=engine, drain_grace_s=0.3)
    deaf = await harness.send(call("deaf", max_tokens=20))
    await asyncio.wait_for(deaf.started.wait(), EVENT_BOUND_S)
    worker.request_stop()
    try:
        # It stopped, though its call's task never ended: that call went back to the stream.
        await asyncio.wait_for(harness.workers[0][1], EVENT_BOUND_S)
        assert worker.counters.handed_back == 1
        await harness.start_worker(SimEngineConfig(step_s=0.001))
        await asyncio.wait_for(deaf.ended.wait(), EVENT_BOUND_S)
    finally:
        engine.release.set()
    assert isinstance(deaf.terminal, Done)
    assert deaf.terminal.attempt == 2


async def test_a_second_stop_hands_back_running_calls_at_once(harness: Harness) -> None:
    # The grace is twice the bound the drain is given here: only a cut-short grace ends it.
    worker = await harness.start_worker(
        SimEngineConfig(step_s=0.05), drain_grace_s=2 * EVENT_BOUND_S
    )
    long = await harness.send(call("long", max_tokens=2000))  # 100 s of tokens
    await asyncio.wait_for(long.started.wait(), EVENT_BOUND_S)
    worker.request_stop()
    worker.request_stop()
    await asyncio.wait_for(harness.workers[0][1], EVENT_BOUND_S)
    assert worker.counters.handed_back == 1
    assert not long.ended.is_set()
    await harness.start_worker(SimEngineConfig(step_s=0.001))
    await asyncio.wait_for(long.ended.wait(), EVENT_BOUND_S)
    assert isinstance(long.terminal, Done)
    assert long.terminal.attempt == 2


async def test_a_cancel_that_overtakes_its_call_stops_it_on_arrival(harness: Harness) -> None:
    worker = await harness.start_worker()
    await harness.doorbells_open()
    await harness.nc.publish("kvgate.cancel.early", b"")

    async def cancels_held() -> dict[str, float]:
        # No public reading says the worker got the cancel: its private memory of them does.
        return worker._cancelled

    await poll_until(
        cancels_held, lambda held: "early" in held, timeout_s=EVENT_BOUND_S, interval_s=0.01
    )
    inbox = await harness.send(call("early", max_tokens=50))
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    assert isinstance(inbox.terminal, Failed)
    assert inbox.terminal.code == ErrorCode.CANCELLED
    assert worker.counters.started == 0


PAST_FIRST_PULLS_S = 3.0
"""The harness's pull requests expire after 2 s; a second more."""
RESERVE_START_BOUND_S = 0.5
"""How soon a guaranteed call starts in the reserve: far below a best-effort call's 4 s."""


async def test_staged_lower_tier_calls_do_not_keep_a_guaranteed_call_out(harness: Harness) -> None:
    config = SimEngineConfig(max_num_seqs=16, kv_capacity_tokens=1024, block_size=16, step_s=0.01)
    headroom = HeadroomSettings(kv_high_water=0.9, guaranteed_reserve=0.25)
    await harness.start_worker(config, headroom=headroom)
    # Each best-effort call costs 416 tokens and runs 4 s: two fit under the high-water mark
    # (921 tokens), the third waits staged, so no room is left for more lower-tier credit.
    low = [
        await harness.send(call(f"be{i}", tier=Tier.BESTEFFORT, max_tokens=400)) for i in range(3)
    ]
    # Past the first pull requests' expiry: every doorbell open now was renewed under that
    # pressure. The time passing is the condition under test.
    await asyncio.sleep(PAST_FIRST_PULLS_S)
    sent = time.monotonic()
    urgent = await harness.send(call("g", tier=Tier.GUARANTEED, max_tokens=10))
    await asyncio.wait_for(urgent.started.wait(), EVENT_BOUND_S)
    # Started in the reserve, not after a best-effort call (4 s).
    assert time.monotonic() - sent < RESERVE_START_BOUND_S
    await asyncio.wait_for(urgent.ended.wait(), EVENT_BOUND_S)
    for inbox in low:
        await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)


class StaleStatsEngine(SimEngine):
    """Reports the reading of a step that is long over, as vLLM does once it goes idle (it
    reports scheduler stats only when it steps)."""

    def stats(self) -> EngineStats:
        return dataclasses.replace(
            super().stats(), kv_cache_usage=0.4, num_running=1, num_waiting=2
        )


async def test_an_idle_worker_reports_idle_whatever_its_engines_last_reading_said(
    harness: Harness,
) -> None:
    worker = Worker(
        StaleStatsEngine(SimEngineConfig(step_s=0.05)),
        WorkerSettings(nats_url=harness.url, worker_id="stale", stream=STREAM),
    )
    assert worker.heartbeat().num_running == 0
    idle = worker.heartbeat()
    assert (idle.kv_cache_usage, idle.num_running, idle.num_waiting) == (0.0, 0, 0)
    task = asyncio.create_task(worker.run())
    harness.workers.append((worker, task))
    inbox = await harness.send(call("busy", max_tokens=20))
    await asyncio.wait_for(inbox.started.wait(), EVENT_BOUND_S)
    busy = worker.heartbeat()  # while its call runs, the engine's reading stands
    assert (busy.kv_cache_usage, busy.num_running, busy.num_waiting) == (0.4, 1, 2)
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)


LONG_ACK_WAIT = StreamSettings(ack_wait_s=4 * EVENT_BOUND_S, max_deliver=3)
"""An ack wait far past every bound here: a call that comes back within a bound was handed
back by the worker, not left to time out."""
LONG_DEADLINE_S = LONG_ACK_WAIT.ack_wait_s
"""Nor may the server drop the call at its deadline (its TTL) within a bound."""


class _FaultsOnFirstAttempt(SimEngine):
    """The first attempt of each call raises an error that is neither the engine's nor a
    cancel, as a fault on the worker's own side does (an ack or a publish that failed or timed
    out, a bug): after the call's first output, or after its last one (when the caller has its
    answer and only the ack is left)."""

    def __init__(self, *, after_last: bool) -> None:
        super().__init__(SimEngineConfig(step_s=0.01))
        self.after_last = after_last
        self.attempted: set[str] = set()

    async def generate(self, prepared: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        first = prepared.request.request_id not in self.attempted
        self.attempted.add(prepared.request.request_id)
        async with contextlib.aclosing(super().generate(prepared)) as outputs:
            async for output in outputs:
                yield output
                if first and self.after_last == (output.finish_reason is not None):
                    raise RuntimeError("a fault outside the engine")


async def faulted_call(harness: Harness, call_id: str, *, after_last: bool) -> Inbox:
    """One call whose first attempt faults outside the engine, served until it ends."""
    engine = _FaultsOnFirstAttempt(after_last=after_last)
    await harness.start_worker(engine=engine, stream=LONG_ACK_WAIT)
    inbox = await harness.send(call(call_id, max_tokens=5, deadline_in_s=LONG_DEADLINE_S))
    # Within EVENT_BOUND_S, a quarter of the ack wait: ended by the worker, not timed out.
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    return inbox


async def assert_fault_handled(
    harness: Harness, call_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Gone from the worker's scheduling state, counted, and logged with the call's id."""
    worker = harness.workers[0][0]

    async def held() -> tuple[int, int]:
        heartbeat = worker.heartbeat()
        return heartbeat.staged, heartbeat.committed_tokens

    # The caller hears the end of a call a moment before the worker lets it go.
    await poll_until(held, lambda h: h == (0, 0), timeout_s=EVENT_BOUND_S, interval_s=0.01)
    assert worker.counters.faulted == 1
    assert any(
        call_id in r.getMessage()
        for r in caplog.records
        if r.name == "workers.worker" and r.levelno >= logging.ERROR
    )


async def test_a_fault_outside_the_engine_hands_the_call_back_at_once(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    inbox = await faulted_call(harness, "fault-mid", after_last=False)
    assert isinstance(inbox.terminal, Done)
    assert inbox.terminal.attempt == 2
    assert not [e for e in inbox.events if isinstance(e, Failed)]
    await assert_fault_handled(harness, "fault-mid", caplog)
    counters = harness.workers[0][0].counters
    assert (counters.completed, counters.ended) == (1, 1)


async def test_a_fault_after_the_answer_ends_the_call_without_a_second_answer(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    inbox = await faulted_call(harness, "fault-end", after_last=True)

    async def queued() -> int:
        return (await harness.js.stream_info(STREAM_NAME)).state.messages

    # Ended for good: not left to come back after the ack wait and be answered again.
    await poll_until(queued, lambda n: n == 0, timeout_s=EVENT_BOUND_S)
    await asyncio.sleep(QUIET_WINDOW_S)  # nothing may follow the terminal event
    assert isinstance(inbox.terminal, Done)
    assert [e.attempt for e in inbox.events if isinstance(e, Done | Failed)] == [1]
    await assert_fault_handled(harness, "fault-end", caplog)
    # Neither completed nor cancelled, yet ended: the accounting counts it all the same.
    counters = harness.workers[0][0].counters
    assert (counters.completed, counters.ended) == (0, 1)


SHORT_ACK_WAIT = StreamSettings(ack_wait_s=1, max_deliver=50)
"""The server delivers a call again after a second without word from its holder; enough
deliveries allowed that a spinning worker would show."""
HELD_FOR_S = 3 * SHORT_ACK_WAIT.ack_wait_s


class _FirstPrepareWaits(SimEngine):
    """Holds the first ``prepare`` until ``release`` is set: the worker holds that call,
    refreshing nothing, past its ack wait, and the server delivers it again meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.preparing = asyncio.Event()
        self.release = asyncio.Event()

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        if not self.preparing.is_set():
            self.preparing.set()
            await self.release.wait()
        return await super().prepare(request)


async def test_a_second_delivery_of_a_call_held_here_does_not_spin(harness: Harness) -> None:
    engine = _FirstPrepareWaits()
    await harness.start_worker(engine=engine, stream=SHORT_ACK_WAIT)
    inbox = await harness.send(call("held", max_tokens=3))
    await asyncio.wait_for(engine.preparing.wait(), EVENT_BOUND_S)
    await asyncio.sleep(HELD_FOR_S)  # held past several ack waits: the condition under test
    engine.release.set()
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    assert isinstance(inbox.terminal, Done)
    assert inbox.terminal.attempt == 1  # the copy held here answered
    info = await harness.js.consumer_info(STREAM_NAME, consumer_name(Tier.STANDARD, MODEL))
    # The first delivery, then about one per ack wait while it was held (two more for timing
    # slack); handing each one back at once spent every delivery the consumer allows.
    assert info.delivered.consumer_seq <= 1 + HELD_FOR_S / SHORT_ACK_WAIT.ack_wait_s + 2


class _PrepareRaises(SimEngine):
    """``prepare`` raises ``fault``, as the serving layer does when the request's chat template
    raises while it renders the request (or a bug does)."""

    def __init__(self, fault: Exception) -> None:
        super().__init__(SimEngineConfig(step_s=0.01))
        self.fault = fault
        self.prepared = 0

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        self.prepared += 1
        raise self.fault


async def ended_on_arrival(harness: Harness, engine: SimEngine, call_id: str) -> Failed:
    """The one terminal event of a call the worker could not prepare, once its message is gone
    from the stream (not left to come back after the ack wait)."""
    await harness.start_worker(engine=engine, stream=LONG_ACK_WAIT)
    inbox = await harness.send(call(call_id, max_tokens=3, deadline_in_s=LONG_DEADLINE_S))
    # Within EVENT_BOUND_S, a quarter of the ack wait: ended by the worker, not timed out.
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)

    async def queued() -> int:
        return (await harness.js.stream_info(STREAM_NAME)).state.messages

    await poll_until(queued, lambda n: n == 0, timeout_s=EVENT_BOUND_S)
    await asyncio.sleep(QUIET_WINDOW_S)  # nothing may follow the terminal event
    assert len(inbox.events) == 1
    assert isinstance(inbox.terminal, Failed)
    return inbox.terminal


async def test_a_call_the_worker_cannot_prepare_fails_once_and_is_terminated(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _PrepareRaises(RuntimeError("the chat template raised"))
    failed = await ended_on_arrival(harness, engine, "fault-arrival")
    assert (failed.code, failed.attempt) == (ErrorCode.INTERNAL_ERROR, 1)
    assert "fault-arrival" in failed.message
    assert engine.prepared == 1  # a fault that would recur is not retried
    await assert_fault_handled(harness, "fault-arrival", caplog)


async def test_an_engine_error_on_arrival_is_reported_after_the_last_attempt(
    harness: Harness,
) -> None:
    engine = _PrepareRaises(EngineError("the engine could not take it"))
    failed = await ended_on_arrival(harness, engine, "engine-arrival")
    assert (failed.code, failed.attempt) == (ErrorCode.ENGINE_ERROR, LONG_ACK_WAIT.max_deliver)
    assert engine.prepared == LONG_ACK_WAIT.max_deliver


async def heartbeats_of(
    harness: Harness, worker: Worker
) -> Callable[[], Awaitable[WorkerHeartbeat | None]]:
    """Reads ``worker``'s last heartbeat from the workers' bucket (None before its first)."""
    bucket = await workers_bucket(harness.js, STREAM)

    async def reading() -> WorkerHeartbeat | None:
        with contextlib.suppress(KeyValueNotFoundError):
            entry = await bucket.get(worker.settings.worker_id)
            return decode_heartbeat(entry.value) if entry.value else None
        return None

    return reading


async def test_a_worker_beats_when_its_calls_start_and_end_not_only_on_its_interval(
    harness: Harness,
) -> None:
    # Admission reads what a worker has not committed from its last heartbeat. With an
    # interval far past this test, every beat after the first is one the worker put because
    # a call was staged, started or ended.
    worker = await harness.start_worker(
        SimEngineConfig(step_s=0.02),
        heartbeat_interval_s=4 * EVENT_BOUND_S,
        reading_interval_s=0.05,
    )
    await harness.doorbells_open()
    reading = await heartbeats_of(harness, worker)
    idle = await poll_until(reading, lambda hb: hb is not None, timeout_s=EVENT_BOUND_S)
    assert idle is not None and (idle.num_running, idle.committed_tokens) == (0, 0)
    inbox = await harness.send(call("seen", max_tokens=250))  # 5 s of tokens
    busy = await poll_until(
        reading,
        lambda hb: hb is not None and hb.num_running == 1,
        timeout_s=EVENT_BOUND_S,
        interval_s=0.02,
    )
    assert busy is not None and busy.committed_tokens > 0
    await asyncio.wait_for(inbox.ended.wait(), EVENT_BOUND_S)
    after = await poll_until(
        reading,
        lambda hb: hb is not None and hb.num_running == 0,
        timeout_s=EVENT_BOUND_S,
        interval_s=0.02,
    )
    assert after is not None and after.committed_tokens == 0


async def test_a_quiet_worker_beats_only_on_its_interval(harness: Harness) -> None:
    worker = await harness.start_worker(
        heartbeat_interval_s=4 * EVENT_BOUND_S, reading_interval_s=0.05
    )
    await harness.doorbells_open()
    bucket = await workers_bucket(harness.js, STREAM)

    async def revision() -> int | None:
        with contextlib.suppress(KeyValueNotFoundError):
            return (await bucket.get(worker.settings.worker_id)).revision
        return None

    first = await poll_until(revision, lambda r: r is not None, timeout_s=EVENT_BOUND_S)
    await asyncio.sleep(QUIET_WINDOW_S)  # ten reading intervals with nothing staged or run
    assert await revision() == first
