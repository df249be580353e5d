"""Reply inboxes: one NATS subscription per front-door process, one queue per call in flight.

Each call gets the inbox ``<prefix>.<call id>``; a single wildcard subscription routes events
to the call's ``ReplyStream``. Events the caller has already seen (same attempt and sequence)
are dropped here, and events of an attempt older than the newest one seen are ignored, so a
slow duplicate from a worker that lost its call never reaches the client.

Core NATS keeps one publisher's messages in order but does not redeliver: events in flight
when a connection drops (a NATS server restart) are lost. A sequence number skipped is such a
loss, and it is counted (``ReplyStream.lost``), never passed over: a stream missing a token
event is a corrupt answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.wire import PROBE_GONE, PROBE_WAITING, Done, Failed, Header, TokenDelta, decode_event

log = logging.getLogger(__name__)

ReplyEvent = TokenDelta | Done | Failed


class ReplyStream:
    def __init__(self, call_id: str, inbox: str) -> None:
        self.call_id = call_id
        self.inbox = inbox
        self.attempt = 0
        self._next_seq = 0
        self.lost = 0
        """Events of the current attempt that never arrived (sequence numbers skipped)."""
        self._pending: deque[ReplyEvent] = deque()
        self._ready = asyncio.Event()

    def feed(self, event: ReplyEvent) -> None:
        if event.attempt < self.attempt:
            return
        if event.attempt > self.attempt:
            self.attempt = event.attempt
            self._next_seq = 0
            self.lost = 0
        if event.seq < self._next_seq:
            return  # duplicate
        self.lost += event.seq - self._next_seq
        self._next_seq = event.seq + 1
        self._pending.append(event)
        self._ready.set()

    async def next_batch(self, timeout: float) -> list[ReplyEvent]:
        """Everything that arrived since the last call, waiting up to ``timeout`` for at least
        one event. Taking all at once is what coalesces tokens for a client slower than the
        engine. Raises ``TimeoutError``."""
        if not self._pending:
            self._ready.clear()
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own, one
            # per batch on the token path.
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._ready.wait()
        batch = list(self._pending)
        self._pending.clear()
        return batch


class ReplyRouter:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self.prefix = nc.new_inbox()
        self._streams: dict[str, ReplyStream] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{self.prefix}.*", cb=self._route)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def open(self, call_id: str) -> ReplyStream:
        stream = ReplyStream(call_id, f"{self.prefix}.{call_id}")
        self._streams[call_id] = stream
        return stream

    def close(self, call_id: str) -> None:
        self._streams.pop(call_id, None)

    @property
    def open_calls(self) -> int:
        return len(self._streams)

    async def _route(self, msg: Msg) -> None:
        call_id = msg.subject.rsplit(".", 1)[-1]
        stream = self._streams.get(call_id)
        if msg.headers and Header.PROBE in msg.headers:
            # A worker asks whether anyone still waits for this call's events.
            if msg.reply:
                await msg.respond(PROBE_WAITING if stream is not None else PROBE_GONE)
            return
        if stream is None:
            return  # the caller gave up; the worker learns through the cancel subject
        try:
            stream.feed(decode_event(msg.data))
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("dropping a malformed reply event for call %s", call_id)
