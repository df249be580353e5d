"""One call's spans on the worker, children of the front door's ``publish`` span (its context
rides in the message's ``traceparent`` header):

- ``queue_wait``: from the call's publish (the stream's timestamp) to its arrival here;
  a redelivery is an event on it.
- ``fetch``: the worker's decision to start it: from arrival to engine start, with the
  headroom it saw and the batch it joined. A call dropped unstarted (deadline passed,
  cancelled, handed back on drain) ends here with error status and the reason.
- ``generate``: the engine's work: ``first_token`` event, tokens in and out, finish reason;
  cancels and engine errors as events and error status.

Spans are started and ended explicitly (never made current), because a call's life spans
several tasks. With tracing off every span is the no-op one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from broker.telemetry import extract_context, ns_from_ms, tracer
from schemas.wire import CallEnvelope, Usage


def _published_ms(msg: Msg, envelope: CallEnvelope) -> int:
    try:
        stamp = msg.metadata.timestamp
    except Exception:  # not a JetStream message (tests publishing on core NATS)
        return envelope.created_ms
    return int(stamp.timestamp() * 1000) if stamp else envelope.created_ms


@dataclass(eq=False)
class CallTrace:
    context: otel_context.Context
    published_ms: int
    attributes: dict[str, str | int]
    fetch: Span = INVALID_SPAN
    generate: Span = INVALID_SPAN
    started_ms: int | None = None
    _ended: bool = field(default=False)

    @classmethod
    def arrived(cls, msg: Msg, envelope: CallEnvelope, attempt: int, worker_id: str) -> CallTrace:
        context = extract_context(msg.headers)
        published_ms = _published_ms(msg, envelope)
        attributes: dict[str, str | int] = {
            "kvgate.call_id": envelope.call_id,
            "kvgate.tier": envelope.tier.value,
            "kvgate.attempt": attempt,
            "kvgate.worker_id": worker_id,
        }
        now_ns = time.time_ns()
        wait = tracer().start_span(
            "queue_wait",
            context=context,
            kind=SpanKind.CONSUMER,
            start_time=min(ns_from_ms(published_ms), now_ns),
            attributes=attributes,
        )
        if attempt > 1:
            wait.add_event("redelivered", {"kvgate.attempt": attempt})
        wait.end(end_time=now_ns)
        fetch = tracer().start_span(
            "fetch", context=context, start_time=now_ns, attributes=attributes
        )
        return cls(context, published_ms, attributes, fetch)

    def staged(self, cost_tokens: int, prepare_ms: float) -> None:
        """Rendered by the serving layer (``prepare_ms`` of the fetch) and waiting to start."""
        self.fetch.set_attributes(
            {"kvgate.cost_tokens": cost_tokens, "kvgate.prepare_ms": round(prepare_ms, 3)}
        )

    def refused(self, reason: str) -> None:
        """The call ends here unstarted."""
        self.fetch.add_event(reason)
        self.fetch.set_status(Status(StatusCode.ERROR, reason))
        self.fetch.end()

    def started(
        self, headroom_tokens: int, batch_size: int, started_together: int, rescued: bool = False
    ) -> None:
        self.fetch.set_attributes(
            {
                "kvgate.headroom_tokens": headroom_tokens,
                "kvgate.batch_size": batch_size,
                "kvgate.started_together": started_together,
                "kvgate.rescued": rescued,
            }
        )
        self.fetch.end()
        self.started_ms = int(time.time() * 1000)
        self.generate = tracer().start_span(
            "generate", context=self.context, attributes=self.attributes
        )

    def queue_wait_ms(self) -> int | None:
        if self.started_ms is None:
            return None
        return max(0, self.started_ms - self.published_ms)

    def first_token(self) -> None:
        self.generate.add_event("first_token")

    def finished(self, finish_reason: str, usage: Usage) -> None:
        self.generate.set_attributes(
            {
                "gen_ai.response.finish_reasons": (finish_reason,),
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
            }
        )

    def stopped(self, why: str) -> None:
        self.generate.add_event(why)
        self.generate.set_status(Status(StatusCode.ERROR, why))

    def failed(self, exc: BaseException) -> None:
        self.generate.record_exception(exc)
        self.generate.set_status(Status(StatusCode.ERROR, type(exc).__name__))

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.generate.end()
