"""A worker's reply relay gathers a streamed answer's tokens into fewer events
(``workers.relay.ReplyRelay``), on real NATS: the first tokens one by one, then a gathering per
``gather_tokens``, everything held sent before the terminal event, nothing lost or reordered."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import Done, Failed, TokenDelta, Usage, decode_event
from workers.relay import ReplyRelay

Event = TokenDelta | Done | Failed

EVENT_TIMEOUT_S = 10.0
"""For a worker's events to reach a local inbox: generous for a loaded host."""


async def relayed(
    nc: NATS, gather_tokens: int, send: list[tuple[str, int]], *, fail: bool = False
) -> list[Event]:
    """The events an inbox receives for ``send`` (text and tokens per engine output), ended by
    ``Done`` (or ``Failed``)."""
    inbox = nc.new_inbox()
    got: asyncio.Queue[Event] = asyncio.Queue()

    async def on(msg: Msg) -> None:
        await got.put(decode_event(msg.data))

    sub = await nc.subscribe(inbox, cb=on)
    relay = ReplyRelay(nc, inbox, attempt=1, worker_id="w", gather_tokens=gather_tokens)
    for i, (sse, tokens) in enumerate(send):
        await relay.token(sse, tokens, queue_wait_ms=7 if i == 0 else None)
    if fail:
        await relay.fail(ErrorCode.ENGINE_ERROR, "boom")
    else:
        await relay.done(FinishReason.STOP, Usage(3, sum(t for _, t in send)))
    events: list[Event] = []
    while not events or not isinstance(events[-1], Done | Failed):
        events.append(await asyncio.wait_for(got.get(), EVENT_TIMEOUT_S))
    await sub.unsubscribe()
    assert relay.tokens_sent == sum(t for _, t in send)
    return events


def texts(events: list[Event]) -> list[str]:
    return [e.sse for e in events if isinstance(e, TokenDelta)]


async def test_the_first_tokens_go_one_by_one_then_in_gatherings(nc: NATS) -> None:
    send = [(f"t{i};", 1) for i in range(14)]
    events = await relayed(nc, 4, send)
    # 4 alone (the first names the worker and its queue wait), then 4 + 4, then the 2 held.
    assert texts(events) == [
        "t0;",
        "t1;",
        "t2;",
        "t3;",
        "t4;t5;t6;t7;",
        "t8;t9;t10;t11;",
        "t12;t13;",
    ]
    assert [e.tokens for e in events if isinstance(e, TokenDelta)] == [1, 1, 1, 1, 4, 4, 2]
    assert [e.seq for e in events] == list(range(8))
    first = events[0]
    assert isinstance(first, TokenDelta)
    assert first.worker_id == "w" and first.queue_wait_ms == 7
    assert isinstance(events[-1], Done)


async def test_an_event_without_text_goes_at_once_with_what_is_held(nc: NATS) -> None:
    # A progress event (a non-streamed call's) or an output with tokens but no text yet.
    send = [("a", 1), ("b", 1), ("c", 1), ("", 5), ("d", 1)]
    events = await relayed(nc, 2, send)
    assert texts(events) == ["a", "b", "c", "d"]
    assert [e.tokens for e in events if isinstance(e, TokenDelta)] == [1, 1, 6, 1]


async def test_held_text_goes_before_a_failure(nc: NATS) -> None:
    events = await relayed(nc, 8, [(f"{i}", 1) for i in range(11)], fail=True)
    assert "".join(texts(events)) == "012345678910"
    assert texts(events)[-1] == "8910"
    assert isinstance(events[-1], Failed)


async def test_one_token_per_event_when_asked(nc: NATS) -> None:
    events = await relayed(nc, 1, [("x", 1)] * 5)
    assert texts(events) == ["x"] * 5
