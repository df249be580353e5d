"""Server-sent events to a client that may stop reading.

A client that stops reading its stream (a stuck agent, a slowloris) does not stop the call:
the worker goes on generating, the front door buffers what the client has not taken, and the
response's task waits on the socket for ever. ``SseResponse`` bounds each write: one that the
client has not taken within ``send_timeout_s`` ends the response, the connection is closed, and
the call's events are closed at once, which cancels the call on its worker. Starlette's own
``StreamingResponse`` waits as long as the socket does; nothing in Starlette or uvicorn bounds
a single write, so this class does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class _ClientStalled(Exception):
    """A write the client did not take in time. Not a ``TimeoutError``: that is an ``OSError``,
    which Starlette reads as the client having disconnected."""


class SseResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        send_timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._events = content
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        # One timer per response, armed only while a write waits on the client: waiting for
        # the call's next events is not the client's stall. Not anyio's ``fail_after`` around
        # each write: that costs a cancel scope and a backend lookup on every token.
        loop = asyncio.get_running_loop()
        bound = asyncio.timeout(None)

        async def bounded(message: Message) -> None:
            bound.reschedule(loop.time() + self.send_timeout_s)
            await send(message)
            bound.reschedule(None)

        try:
            async with bound:
                await super().stream_response(bounded)
        except TimeoutError:
            if not bound.expired():
                raise
            # Starlette would read a ``TimeoutError`` (an ``OSError``) as the client having
            # disconnected.
            raise _ClientStalled from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except* _ClientStalled:
            # The connection is closed by the server once this returns with the response
            # unfinished; the events are closed now, not when the generator is collected.
            log.warning(
                "a client read nothing of its stream for %.0f s; its stream is closed and its "
                "call cancelled",
                self.send_timeout_s,
            )
            close = getattr(self._events, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
