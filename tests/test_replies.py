"""Reply ordering rules in the front door: duplicates dropped, stale attempts ignored, lost
events counted and a streamed call with a hole in its answer ended with ``worker_lost``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from api.calls import CallLine, Restarted, follow_call
from api.metrics import FrontDoorMetrics
from api.replies import ReplyEvent, ReplyRouter, ReplyStream
from broker.admission.objectives import Objective, Verdict
from broker.admission.signals import FleetSignals
from broker.errors import WorkerLost
from broker.fleet import FleetView
from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls
from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import (
    Done,
    Failed,
    Header,
    TokenDelta,
    Usage,
    call_subject,
    decode_event,
    encode,
)
from tests.calls import make_call
from workers.relay import ReplyRelay

PROBE_TIMEOUT_S = 10.0
"""For the front door's answer to a probe: generous for a loaded machine (an answer that does
not come in time reads as "still waiting", which would fail the "gone" checks)."""


def tok(seq: int, text: str, attempt: int = 1) -> TokenDelta:
    return TokenDelta(seq=seq, attempt=attempt, sse=text, tokens=1)


async def test_duplicates_are_dropped_and_batches_coalesce() -> None:
    stream = ReplyStream("c", "inbox")
    for event in (tok(0, "a"), tok(1, "b"), tok(1, "b"), tok(0, "a"), tok(2, "c")):
        stream.feed(event)
    batch = await stream.next_batch(1)
    assert [e.sse for e in batch if isinstance(e, TokenDelta)] == ["a", "b", "c"]


async def test_a_newer_attempt_supersedes_and_older_events_are_ignored() -> None:
    stream = ReplyStream("c", "inbox")
    stream.feed(tok(0, "a", attempt=1))
    stream.feed(tok(0, "x", attempt=2))
    stream.feed(tok(1, "b", attempt=1))  # the lost worker's late event
    stream.feed(tok(1, "y", attempt=2))
    batch = await stream.next_batch(1)
    assert [(e.attempt, e.sse) for e in batch if isinstance(e, TokenDelta)] == [
        (1, "a"),
        (2, "x"),
        (2, "y"),
    ]


async def test_skipped_sequence_numbers_count_as_lost_for_their_attempt() -> None:
    stream = ReplyStream("c", "inbox")
    for event in (tok(0, "a"), tok(2, "c"), tok(5, "f")):
        stream.feed(event)
    assert stream.lost == 3
    stream.feed(tok(0, "x", attempt=2))  # a new attempt starts over
    assert stream.lost == 0
    stream.feed(tok(2, "z", attempt=3))  # its first two events never came
    assert stream.lost == 2


async def test_waiting_with_nothing_times_out() -> None:
    with pytest.raises(TimeoutError):
        await ReplyStream("c", "inbox").next_batch(0.05)


def test_events_round_trip_through_the_wire_encoding() -> None:
    events = [
        tok(0, "héllo\u2028"),
        Done(1, 1, FinishReason.LENGTH, Usage(3, 4)),
        Failed(0, 2, ErrorCode.DEADLINE_EXCEEDED, "late"),
    ]
    for event in events:
        assert decode_event(encode(event)) == event


def test_a_workers_deadline_event_becomes_a_504_with_retry_after() -> None:
    from api.calls import failure_error
    from api.errors import error_response

    response = error_response(failure_error(Failed(0, 1, ErrorCode.DEADLINE_EXCEEDED, "late")))
    assert response.status_code == 504
    assert response.headers["retry-after"] == "1"


async def test_a_worker_learns_whether_its_caller_still_waits(nc: NATS) -> None:
    """The probe a worker sends to a call's inbox (``ReplyRelay.caller_gone``), answered by a
    front door's router on real NATS: waiting while the call is open, gone once the caller let
    it go, and gone with no front door at all (NATS's "no responders")."""
    router = ReplyRouter(nc)
    await router.start()
    stream = router.open("c1")
    relay = ReplyRelay(nc, stream.inbox, attempt=1, worker_id="w")
    assert not await relay.caller_gone(timeout_s=PROBE_TIMEOUT_S)
    router.close("c1")
    assert await relay.caller_gone(timeout_s=PROBE_TIMEOUT_S)
    router.open("c1")
    await router.stop()  # the front door died
    assert await relay.caller_gone(timeout_s=PROBE_TIMEOUT_S)


EVENT_TIMEOUT_S = 10.0
"""For a call's events to reach the front door over a local NATS: generous for a loaded host."""


async def followed(
    nc: NATS,
    *,
    stream: bool,
    events: list[ReplyEvent],
    objective: Objective | None = None,
    judge: Callable[[Verdict], None] = lambda _: None,
    before_answer: Callable[[], Awaitable[None]] | None = None,
) -> list[ReplyEvent]:
    """Publish a call through ``follow_call`` on real NATS, answer it with ``events`` as its
    worker would (some of them lost on the way; after ``before_answer``, if given), and return
    what the front door yields."""
    await provision_calls(nc.jetstream(), StreamSettings())
    router = ReplyRouter(nc)
    await router.start()
    line = CallLine(
        CallPublisher(nc.jetstream()),
        router,
        nc,
        stream_idle_timeout_s=EVENT_TIMEOUT_S,
        metrics=FrontDoorMetrics(FleetSignals(FleetView(6.0))),
        judge=judge,
    )
    call = make_call("gap", stream=stream)
    seen: list[ReplyEvent] = []

    async def worker(msg: Msg) -> None:
        assert msg.headers is not None
        if before_answer is not None:
            await before_answer()
        for event in events:
            await nc.publish(msg.headers[Header.REPLY], encode(event))

    # A core subscription on the call's subject gets the call as the stream stores it.
    sub = await nc.subscribe(call_subject(call.tier, call.model), cb=worker)
    try:
        async for item in follow_call(line, call, objective):
            assert not isinstance(item, Restarted)
            seen += item
    finally:
        await sub.unsubscribe()
        await router.stop()
    return seen


async def test_a_streamed_call_missing_a_reply_event_ends_with_worker_lost(nc: NATS) -> None:
    """Event 1 (a token) was lost, as when the worker's connection dropped with it unsent:
    the client must not get the rest of the answer as if it were whole."""
    done = Done(3, 1, FinishReason.LENGTH, Usage(3, 3))
    with pytest.raises(WorkerLost, match="1 of the call's reply events were lost"):
        await followed(nc, stream=True, events=[tok(0, "a"), tok(2, "c"), done])


async def test_a_plain_call_missing_a_progress_event_still_gets_its_whole_body(nc: NATS) -> None:
    done = Done(2, 1, FinishReason.LENGTH, Usage(3, 3), body=b"{}")
    seen = await followed(nc, stream=False, events=[tok(0, ""), done])
    assert seen[-1] == done


async def test_a_call_not_started_within_its_first_token_objective_is_judged_then(
    nc: NATS,
) -> None:
    """Admission learns of the miss while the call still waits, not once it has run, and the
    call's end judges it no second time."""
    verdicts: list[bool] = []
    judged = asyncio.Event()

    def judge(verdict: Verdict) -> None:
        verdicts.append(verdict.met)
        judged.set()

    async def wait_for_the_verdict() -> None:
        # Without the early verdict this waits out the timeout and the assertion below fails.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(judged.wait(), EVENT_TIMEOUT_S)
        judged_while_waiting.append(judged.is_set())

    judged_while_waiting: list[bool] = []
    done = Done(1, 1, FinishReason.LENGTH, Usage(3, 1))
    await followed(
        nc,
        stream=True,
        events=[tok(0, "a"), done],
        objective=Objective(ttft_s=0.05, tpot_s=1.0),
        judge=judge,
        before_answer=wait_for_the_verdict,
    )
    assert judged_while_waiting == [True]
    assert verdicts == [False]


async def test_a_call_answered_in_time_is_judged_once_when_it_ends(nc: NATS) -> None:
    verdicts: list[bool] = []
    objective = Objective(ttft_s=EVENT_TIMEOUT_S, tpot_s=EVENT_TIMEOUT_S)
    done = Done(1, 1, FinishReason.LENGTH, Usage(3, 1))
    await followed(
        nc,
        stream=True,
        events=[tok(0, "a"), done],
        objective=objective,
        judge=lambda verdict: verdicts.append(verdict.met),
    )
    assert verdicts == [True]
