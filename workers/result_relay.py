"""The relay for batch calls: no token events (nobody is waiting on an inbox), one durable
result at the end, published to JetStream before the call is acked, so that a result exists
for every call the worker finishes, whatever crashes next."""

from __future__ import annotations

from nats.js import JetStreamContext

from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import RESULTS_STREAM, CallResult, Header, Usage, encode


class ResultRelay:
    def __init__(self, js: JetStreamContext, subject: str, call_id: str, attempt: int) -> None:
        self._js = js
        self._subject = subject
        self._call_id = call_id
        self._attempt = attempt
        self.tokens_sent = 0
        self.finished = False

    async def caller_gone(self, timeout_s: float) -> bool:
        """Never: a batch's result is durable, and its batch is what waits for it."""
        return False

    async def token(self, sse: str, tokens: int, queue_wait_ms: int | None = None) -> None:
        # Batch calls are never streamed: the answer is the body given to ``done``.
        self.tokens_sent += tokens

    async def done(
        self, finish_reason: FinishReason, usage: Usage, body: bytes | None = None
    ) -> None:
        result = CallResult(
            self._call_id, self._attempt, body=body, finish_reason=finish_reason, usage=usage
        )
        await self._publish(result)

    async def fail(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        if self.finished:
            return
        await self._publish(
            CallResult(self._call_id, self._attempt, error_code=code, error_message=message)
        )

    async def _publish(self, result: CallResult) -> None:
        if self.finished:
            raise RuntimeError("result already published")
        # Raises if JetStream does not confirm: the call is then not acked, and comes back.
        await self._js.publish(
            self._subject,
            encode(result),
            stream=RESULTS_STREAM,
            headers={Header.MSG_ID: f"{self._call_id}:{self._attempt}"},
            timeout=5,
        )
        self.finished = True
