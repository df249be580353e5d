"""One call's life in the front door: queue it, then follow its reply events to the end.

Time limits: the first event must arrive before the call's deadline (the same deadline the
worker and the server's ``Nats-TTL`` enforce, so a call nobody started ends at its deadline,
never hangs); after that, the worker may go silent for at most ``stream_idle_timeout_s``.
Whenever the caller stops following before a terminal event (gave up, disconnected, timed
out), the call is cancelled so the worker frees its KV cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from api.replies import ReplyEvent
from api.state import FrontDoor
from broker.errors import DeadlineExceeded, KvgateError
from schemas.vocab import ErrorCode
from schemas.wire import CANCEL_SUBJECT_PREFIX, CallEnvelope, Done, Failed, TokenDelta


@dataclass(frozen=True, slots=True)
class Restarted:
    """The call was delivered again (its worker was lost); events start over from here."""

    attempt: int


async def follow_call(
    door: FrontDoor, call: CallEnvelope
) -> AsyncGenerator[list[ReplyEvent] | Restarted, None]:
    """Publish ``call`` and yield its reply events in arrival batches until the terminal one.

    Raises ``KvgateError`` (from publishing, or a timeout); a worker's ``Failed`` event is
    yielded like any other, since what it means depends on what the client already has.
    """
    stream = door.replies.open(call.call_id)
    finished = False
    observed = _CallObservation(door, call)
    try:
        await door.publisher.publish(call, stream.inbox, now_ms=int(time.time() * 1000))
        observed.published()
        attempt: int | None = None
        while True:
            if attempt is None:
                timeout = call.deadline_ms / 1000 - time.time()
            else:
                timeout = door.settings.stream_idle_timeout_s
            try:
                batch = await stream.next_batch(timeout)
            except TimeoutError:
                if attempt is None:
                    raise DeadlineExceeded(
                        "no worker started the call before its deadline "
                        f"({(call.deadline_ms - call.created_ms) / 1000:g}s)"
                    ) from None
                raise KvgateError(
                    ErrorCode.WORKER_LOST,
                    f"the worker sent nothing for {door.settings.stream_idle_timeout_s:g}s",
                ) from None
            observed.events(batch)
            current: list[ReplyEvent] = []
            for event in batch:
                if attempt is not None and event.attempt != attempt:
                    if current:
                        yield current
                        current = []
                    yield Restarted(event.attempt)
                attempt = event.attempt
                current.append(event)
                if isinstance(event, Done | Failed):
                    finished = True
                    yield current
                    return
            yield current
    except KvgateError as exc:
        observed.ended(exc.code.value)
        raise
    finally:
        observed.ended("abandoned")
        door.replies.close(call.call_id)
        if not finished:
            with contextlib.suppress(Exception):
                await door.nc.publish(f"{CANCEL_SUBJECT_PREFIX}{call.call_id}", b"")


class _CallObservation:
    """Feeds one call's timings and outcome to the front door's metrics."""

    def __init__(self, door: FrontDoor, call: CallEnvelope) -> None:
        self._metrics = door.metrics
        self._tier = call.tier.value
        self._created_s = call.created_ms / 1000
        self._published: float | None = None
        self._first_event = False
        self._first_token: float | None = None
        self._outcome: str | None = None

    def published(self) -> None:
        self._published = time.monotonic()

    def events(self, batch: list[ReplyEvent]) -> None:
        now = time.monotonic()
        if not self._first_event and self._published is not None:
            self._first_event = True
            self._metrics.first_event.labels(self._tier).observe(now - self._published)
        tokens = 0
        for event in batch:
            if isinstance(event, TokenDelta):
                tokens += event.tokens
            elif isinstance(event, Done):
                self._done(event, now)
            elif isinstance(event, Failed):
                self.ended(event.code.value)
        if tokens:
            self._metrics.tokens.labels(self._tier).inc(tokens)
            if self._first_token is None:
                self._first_token = now
                self._metrics.ttft.labels(self._tier).observe(time.time() - self._created_s)

    def _done(self, event: Done, now: float) -> None:
        if self._first_token is not None and event.usage.completion_tokens > 1:
            per_token = (now - self._first_token) / (event.usage.completion_tokens - 1)
            self._metrics.tpot.labels(self._tier).observe(per_token)
        self.ended("ok")

    def ended(self, outcome: str) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self._metrics.calls.labels(self._tier, outcome).inc()


def failure_error(event: Failed) -> KvgateError:
    if event.code == ErrorCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(event.message)
    return KvgateError(event.code, event.message)
