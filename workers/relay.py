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
    sees two endings for one attempt.

    Gathers a streamed answer's text into events of ``gather_tokens`` tokens: each event costs a
    NATS message, a front door's dispatch, an SSE write and the client's parse, and gathering 8
    halved the front door's and the client's CPU per streamed token
    (``loadtests/results/stream-gather``). The first ``gather_tokens`` tokens still go one by
    one, as they come: the first token's text may be empty (held back by the detokenizer or a
    tool-call parser), and the first visible text must not wait for a gathering. vLLM's own
    ``--stream-interval`` gathers from the second token on, and so delayed the first text of
    18% of calls by a whole interval (``loadtests/results/stream-interval``). Held text waits
    for the engine's next output: a model that decodes slowly shows it in bursts (1 streams
    every token, for people watching). What a relay holds goes before its terminal event; an
    event without text (a non-streamed call's progress) goes at once, with what is held."""

    def __init__(
        self, nc: NATS, inbox: str, attempt: int, worker_id: str, gather_tokens: int = 1
    ) -> None:
        self._nc = nc
        self._inbox = inbox
        self._attempt = attempt
        self._worker_id = worker_id
        self._gather_tokens = gather_tokens
        self._seq = 0
        self._held: list[str] = []
        self._held_tokens = 0
        self._held_queue_wait_ms: int | None = None
        self.tokens_sent = 0
        """Tokens the caller was sent; held ones are not."""
        self.finished = False

    async def token(self, sse: str, tokens: int, queue_wait_ms: int | None = None) -> None:
        self._held.append(sse)
        self._held_tokens += tokens
        if queue_wait_ms is not None:
            self._held_queue_wait_ms = queue_wait_ms
        if (
            not sse
            or self.tokens_sent < self._gather_tokens
            or self._held_tokens >= self._gather_tokens
        ):
            await self._flush()

    async def _flush(self) -> None:
        if not self._held:
            return
        seq = self._next()
        # The first token names the worker, so the caller can tell which one served it.
        worker_id = self._worker_id if seq == 0 else None
        event = TokenDelta(
            seq,
            self._attempt,
            "".join(self._held),
            self._held_tokens,
            self._held_queue_wait_ms,
            worker_id=worker_id,
        )
        tokens = self._held_tokens
        self._held.clear()
        self._held_tokens = 0
        self._held_queue_wait_ms = None
        await self._send(event)
        self.tokens_sent += tokens

    async def done(
        self, finish_reason: FinishReason, usage: Usage, body: bytes | None = None
    ) -> None:
        await self._flush()
        event = Done(
            self._next(), self._attempt, finish_reason, usage, body, worker_id=self._worker_id
        )
        await self._send(event)
        self.finished = True

    async def fail(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        if self.finished:
            return
        # What was generated before the failure is the caller's, as it would have been unheld.
        await self._flush()
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
