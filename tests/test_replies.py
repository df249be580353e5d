"""Reply ordering rules in the front door: duplicates dropped, stale attempts ignored."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from api.replies import ReplyRouter, ReplyStream
from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import Done, Failed, TokenDelta, Usage, decode_event, encode
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
