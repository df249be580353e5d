"""One call's life in the front door: queue it, then follow its reply events to the end.

Time limits: the first event must arrive before the call's deadline (the same deadline the
worker and the server's ``Nats-TTL`` enforce, so a call nobody started ends at its deadline,
never hangs); after that, the worker may go silent for at most ``stream_idle_timeout_s``.
Whenever the caller stops following before a terminal event (gave up, disconnected, timed
out), the call is cancelled so the worker frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

import anyio
from nats.aio.client import Client as NATS
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from api.metrics import FrontDoorMetrics
from api.replies import ReplyEvent, ReplyRouter
from broker.admission.objectives import Objective, Verdict
from broker.errors import DeadlineExceeded, KvgateError, WorkerLost, error_class
from broker.publisher import CallPublisher
from broker.telemetry import inject_headers, tracer
from schemas.vocab import ErrorCode
from schemas.wire import (
    CANCEL_SUBJECT_PREFIX,
    CallEnvelope,
    Done,
    Failed,
    TokenDelta,
    call_subject,
)


@dataclass(frozen=True, slots=True)
class Restarted:
    """The call was delivered again (its worker was lost); events start over from here."""

    attempt: int


@dataclass(frozen=True, slots=True)
class CallLine:
    """What following a call needs of the front door, and nothing more: where calls are
    published, where their replies arrive, where cancels go, how long a started call may stay
    silent, the call metrics, and admission's judge of calls against their objectives."""

    publisher: CallPublisher
    replies: ReplyRouter
    nc: NATS
    stream_idle_timeout_s: float
    metrics: FrontDoorMetrics
    judge: Callable[[Verdict], None]
    """Admission's judge (``broker.admission.objectives`` weighs calls by session)."""


async def follow_call(
    line: CallLine,
    call: CallEnvelope,
    objective: Objective | None = None,
    *,
    session_calls: int = 1,
    session_admitted_ms: int | None = None,
) -> AsyncGenerator[list[ReplyEvent] | Restarted, None]:
    """Publish ``call`` and yield its reply events in arrival batches until the terminal one.
    A call with an ``objective`` is judged against it for admission, as one of the
    ``session_calls`` its session declared (admitted at ``session_admitted_ms``): when it
    ends, or when its first-token objective runs out before a worker started it
    (``_CallObservation``).

    Raises ``KvgateError`` (from publishing, a timeout, or ``WorkerLost`` when a streamed
    call's reply events were lost in transit); a worker's ``Failed`` event is yielded like any
    other, since what it means depends on what the client already has.
    """
    stream = line.replies.open(call.call_id)
    finished = False
    observed = _CallObservation(line, call, objective, session_calls, session_admitted_ms)
    # Spans are started and ended by hand, not made current: this generator yields, and a
    # context made current here would leak into (or be reset from) the consumer's context.
    parent = otel_context.get_current()
    attributes = {
        "kvgate.call_id": call.call_id,
        "kvgate.session_id": call.session_id,
        "kvgate.tier": call.tier.value,
    }
    publish_span = tracer().start_span(
        "publish",
        context=parent,
        kind=SpanKind.PRODUCER,
        attributes={
            **attributes,
            "messaging.system": "nats",
            "messaging.destination.name": call_subject(call.tier, call.model),
            "kvgate.deadline_ms": call.deadline_ms,
        },
    )
    stream_span: Span | None = None
    try:
        trace_headers = inject_headers({}, trace.set_span_in_context(publish_span, parent))
        # Timed from before the publish: a fast worker's first events can arrive before the
        # stream's acknowledgement does.
        observed.publishing()
        try:
            seq = await line.publisher.publish(
                call, stream.inbox, now_ms=int(time.time() * 1000), trace_headers=trace_headers
            )
            publish_span.set_attribute("messaging.message.id", str(seq))
        except KvgateError as exc:
            publish_span.set_status(Status(StatusCode.ERROR, exc.code.value))
            raise
        finally:
            publish_span.end()
        stream_span = tracer().start_span("stream", context=parent, attributes=attributes)
        observed.span = stream_span
        attempt: int | None = None
        while True:
            if attempt is None:
                timeout = call.deadline_ms / 1000 - time.time()
            else:
                timeout = line.stream_idle_timeout_s
            try:
                batch = await stream.next_batch(timeout)
            except TimeoutError:
                if attempt is None:
                    raise DeadlineExceeded(
                        "no worker started the call before its deadline "
                        f"({(call.deadline_ms - call.created_ms) / 1000:g}s)"
                    ) from None
                raise WorkerLost(
                    f"the worker sent nothing for {line.stream_idle_timeout_s:g}s",
                ) from None
            if call.stream and stream.lost:
                # The client would get an answer with a hole in it, told it was complete.
                # Not streamed, the lost events were progress only: the body comes whole.
                raise WorkerLost(
                    f"{stream.lost} of the call's reply events were lost on the way "
                    "(the connection to NATS dropped)"
                )
            observed.events(batch)
            current: list[ReplyEvent] = []
            for event in batch:
                if attempt is not None and event.attempt != attempt:
                    stream_span.add_event("redelivered", {"kvgate.attempt": event.attempt})
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
        line.replies.close(call.call_id)
        if not finished:
            # Shielded: a disconnected streaming client's cancel scope would cut the publish,
            # and the worker would only learn from its next probe that nobody waits.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await line.nc.publish(f"{CANCEL_SUBJECT_PREFIX}{call.call_id}", b"")
        if stream_span is not None:
            stream_span.end()


class _CallObservation:
    """Feeds one call's timings and outcome to the front door's metrics, and its verdict
    against its objective to admission.

    The verdict times the first token from the publish, not from the request: a call that
    waited for one of its own session's slots waited on its session, not on the fleet, and
    admission must not shrink the fleet's window for it.

    A call that has not started when its time-to-first-token objective runs out has missed
    it, whatever follows, and is judged then rather than when it ends: the windows learn of a
    burst the fleet cannot start in time while it is happening, not a call's length later,
    when more sessions have been admitted into it. The verdict is given once."""

    def __init__(
        self,
        line: CallLine,
        call: CallEnvelope,
        objective: Objective | None,
        session_calls: int,
        session_admitted_ms: int | None,
    ) -> None:
        self._metrics = line.metrics
        self._judge_call = line.judge
        self._objective = objective
        # What the verdict says of the call besides whether it met its objective, known now.
        self._verdict = Verdict(
            call.tier,
            met=False,
            session=call.session_id,
            session_calls=session_calls,
            admitted_s=None if session_admitted_ms is None else session_admitted_ms / 1000,
        )
        self._tier = call.tier.value
        self._created_s = call.created_ms / 1000
        self._published: float | None = None
        self._first_event_at: float | None = None
        self._first_token: float | None = None
        self._outcome: str | None = None
        self._judged = False
        self._overdue: asyncio.TimerHandle | None = None
        self._tokens = 0
        # Looked up once: a labelled child costs a lock and a lookup, and this one is counted
        # on every batch of tokens.
        self._token_counter = line.metrics.tokens.labels(self._tier)
        self.span: Span | None = None

    def publishing(self) -> None:
        self._published = time.monotonic()
        if self._objective is not None:
            self._overdue = asyncio.get_running_loop().call_later(
                self._objective.ttft_s, self._first_token_overdue
            )

    def _first_token_overdue(self) -> None:
        # No event at all yet: not even the worker's start, which a streamed call's first
        # token follows and a whole answer's verdict stands on. Once started, the call is
        # judged when it ends, by its actual first token.
        if self._outcome is None and self._first_event_at is None:
            self._judge(False)

    def events(self, batch: list[ReplyEvent]) -> None:
        now = time.monotonic()
        if self._first_event_at is None and self._published is not None:
            self._first_event_at = now
            self._metrics.first_event.labels(self._tier).observe(now - self._published)
        tokens = 0
        for event in batch:
            if isinstance(event, TokenDelta):
                tokens += event.tokens
                if event.queue_wait_ms is not None:
                    self._metrics.queue_wait.labels(self._tier).observe(event.queue_wait_ms / 1000)
            elif isinstance(event, Done):
                if event.body is not None:
                    # Not streamed: the answer's tokens arrive with the body (progress events
                    # counted none of them).
                    tokens = event.usage.completion_tokens - self._tokens
                self._done(event, now)
            elif isinstance(event, Failed):
                self.ended(event.code.value)
        if tokens:
            self._tokens += tokens
            self._token_counter.inc(tokens)
            if self._first_token is None:
                self._first_token = now
                self._metrics.ttft.labels(self._tier).observe(time.time() - self._created_s)
                if self.span is not None:
                    self.span.add_event("first_token")

    def _done(self, event: Done, now: float) -> None:
        per_token: float | None = None
        if self._first_token is not None and event.usage.completion_tokens > 1:
            per_token = (now - self._first_token) / (event.usage.completion_tokens - 1)
            self._metrics.tpot.labels(self._tier).observe(per_token)
        if self._outcome is None and self._objective is not None:
            # Not streamed, the answer comes whole; the worker's start event stands in for
            # the first token (it comes when the engine takes the call, before prefill).
            first = self._first_token or self._first_event_at
            ttft = None if first is None or self._published is None else first - self._published
            if per_token is None and first is not None and event.usage.completion_tokens > 1:
                per_token = (now - first) / (event.usage.completion_tokens - 1)
            self._judge(self._objective.met(ttft, per_token))
        self.ended("ok")

    def _judge(self, met: bool) -> None:
        if self._judged:
            return
        self._judged = True
        self._judge_call(replace(self._verdict, met=met))
        self._metrics.objective_met.labels(self._tier, "yes" if met else "no").inc()

    def ended(self, outcome: str) -> None:
        if self._overdue is not None:
            self._overdue.cancel()
        if self._outcome is None:
            # A call the fleet was too slow to start missed; one its caller left, or that
            # failed on its own request, says nothing about the fleet's load.
            if outcome == ErrorCode.DEADLINE_EXCEEDED.value and self._objective is not None:
                self._judge(False)
            self._outcome = outcome
            self._metrics.calls.labels(self._tier, outcome).inc()
            if self.span is not None:
                self.span.set_attribute("kvgate.outcome", outcome)
                self.span.set_attribute("kvgate.tokens_out", self._tokens)
                if outcome != "ok":
                    self.span.set_status(Status(StatusCode.ERROR, outcome))


def failure_error(event: Failed) -> KvgateError:
    """The error of a worker's ``Failed`` event: its code's class, as if raised here."""
    return error_class(event.code, KvgateError)(event.message, param=event.param)
