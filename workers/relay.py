"""Reply events for one attempt of one call, published on core NATS to the caller's inbox."""

from __future__ import annotations

from typing import Protocol

import nats.errors
from nats.aio.client import Client as NATS

from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import PROBE_GONE, Done, Failed, Header, TokenDelta, Usage, encode


class Relay(Protocol):
    """Where a call's events go: a caller's inbox (``ReplyRelay``) or, for a batch call, one
    durable result (``workers.result_relay.ResultRelay``)."""

    tokens_sent: int
    finished: bool

    async def token(self, sse: str, tokens: int, queue_wait_ms: int | None = None) -> None: ...

    async def done(
        self, finish_reason: FinishReason, usage: Usage, body: bytes | None = None
    ) -> None: ...

    async def fail(self, code: ErrorCode, message: str, param: str | None = None) -> None: ...

    async def caller_gone(self, timeout_s: float) -> bool:
        """Whether nobody waits for this call's answer any more (asked of the caller's front
        door; not knowing is not gone)."""
        ...


class ReplyRelay:
    """Numbers events from 0 and refuses anything after the terminal event, so a caller never
    sees two endings for one attempt."""

    def __init__(self, nc: NATS, inbox: str, attempt: int, worker_id: str) -> None:
        self._nc = nc
        self._inbox = inbox
        self._attempt = attempt
        self._worker_id = worker_id
        self._seq = 0
        self.tokens_sent = 0
        self.finished = False

    async def token(self, sse: str, tokens: int, queue_wait_ms: int | None = None) -> None:
        seq = self._next()
        # The first token names the worker, so the caller can tell which one served it.
        worker_id = self._worker_id if seq == 0 else None
        await self._send(
            TokenDelta(seq, self._attempt, sse, tokens, queue_wait_ms, worker_id=worker_id)
        )
        self.tokens_sent += tokens

    async def done(
        self, finish_reason: FinishReason, usage: Usage, body: bytes | None = None
    ) -> None:
        event = Done(
            self._next(), self._attempt, finish_reason, usage, body, worker_id=self._worker_id
        )
        await self._send(event)
        self.finished = True

    async def fail(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        if self.finished:
            return
        await self._send(Failed(self._next(), self._attempt, code, message, param))
        self.finished = True

    async def caller_gone(self, timeout_s: float) -> bool:
        """Asks the caller's inbox. Gone: no subscriber at all (the front door died: NATS
        answers "no responders" at once), or the front door no longer has the call open. A
        front door too busy to answer, or a connection being re-established, is not gone."""
        try:
            reply = await self._nc.request(
                self._inbox, b"", timeout=timeout_s, headers={Header.PROBE: "1"}
            )
        except nats.errors.NoRespondersError:
            return True
        except (nats.errors.Error, TimeoutError):
            return False
        return reply.data == PROBE_GONE

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    async def _send(self, event: TokenDelta | Done | Failed) -> None:
        if self.finished:
            raise RuntimeError("reply already finished")
        await self._nc.publish(self._inbox, encode(event))
