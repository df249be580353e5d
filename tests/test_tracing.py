"""Tracing: the shared stack's front door and vLLM worker (separate processes, real NATS) export
over OTLP/HTTP to a receiver in this process that decodes the protobuf payloads; the gRPC
exporter is checked against a gRPC receiver; JSON logs carry the trace id."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from broker.telemetry import tracing_wanted
from schemas.vocab import Tier
from schemas.wire import call_subject
from tests.conftest import Stack
from tests.otlp import OtlpGrpcReceiver, ReceivedSpan, SpanStore
from tests.polling import poll_until

MODEL = "kvgate-dev"
API, WORKER = "kvgate-api", "kvgate-worker"


def traceparent() -> tuple[str, str, str]:
    """A caller's own trace context, so the test can find its trace among all the stack's."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def spans_of(
    store: SpanStore, trace_id: str, done: Callable[[list[ReceivedSpan]], bool]
) -> list[ReceivedSpan]:
    async def read() -> list[ReceivedSpan]:
        return store.trace(trace_id)

    return await poll_until(read, done, timeout_s=15, interval_s=0.1)


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_one_call_is_one_trace_across_the_front_door_and_the_worker(
    stack: Stack, stream: bool
) -> None:
    header, trace_id, caller_span = traceparent()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "trace me"}],
                "max_tokens": 12,
                "ignore_eos": True,
                "stream": stream,
            },
            headers={"traceparent": header},
        )
        await resp.aread()
    assert resp.status_code == 200
    names = {"POST /v1/chat/completions", "admission", "publish", "stream"}
    names |= {"queue_wait", "fetch", "generate"}
    spans = await spans_of(stack.traces, trace_id, lambda s: names <= {x.name for x in s})

    http = one(spans, "POST /v1/chat/completions")
    admission, publish, streamed = (one(spans, n) for n in ("admission", "publish", "stream"))
    queue_wait, fetch, generate = (one(spans, n) for n in ("queue_wait", "fetch", "generate"))
    assert {s.service for s in (http, admission, publish, streamed)} == {API}
    assert {s.service for s in (queue_wait, fetch, generate)} == {WORKER}
    # Parenting: the caller's span -> HTTP -> admission, publish, stream; the worker's spans
    # hang off publish (its context rode in the message's traceparent header).
    assert http.parent_span_id == caller_span
    assert admission.parent_span_id == publish.parent_span_id == http.span_id
    assert streamed.parent_span_id == http.span_id
    assert {s.parent_span_id for s in (queue_wait, fetch, generate)} == {publish.span_id}
    # Each span says what happened.
    assert http.attributes["http.response.status_code"] == 200
    assert admission.attributes["kvgate.decision"] == "admit"
    assert admission.attributes["kvgate.reason"] == "admitted"
    assert admission.attributes["kvgate.scope"] == "call"
    assert admission.attributes["kvgate.signal.workers_live"] == 1
    assert publish.attributes["messaging.destination.name"] == call_subject(Tier.STANDARD, MODEL)
    assert publish.attributes["kvgate.deadline_ms"] > 0
    call_id = resp.headers["x-kvgate-call"]
    assert queue_wait.attributes["kvgate.call_id"] == call_id
    assert queue_wait.start_ns <= queue_wait.end_ns <= fetch.end_ns <= generate.end_ns
    assert fetch.attributes["kvgate.batch_size"] >= 1 and "kvgate.headroom_tokens" in (
        fetch.attributes
    )
    assert "first_token" in generate.events
    assert generate.attributes["gen_ai.usage.output_tokens"] == 12
    assert generate.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert streamed.attributes["kvgate.outcome"] == "ok"
    assert "first_token" in streamed.events
    assert streamed.end_ns <= http.end_ns


async def test_a_refused_session_span_carries_the_decision_and_reason_and_logs_the_trace_id(
    stack: Stack,
) -> None:
    header, trace_id, _ = traceparent()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        resp = await client.post(
            "/v1/sessions",
            json={
                "tier": "standard",
                "max_parallel": 256,
                "min_parallel": 256,
                "est_prompt_tokens": 4000,
                "est_output_tokens": 4000,
            },
            headers={"traceparent": header},
        )
    assert (resp.status_code, resp.json()["error"]["code"]) == (503, "exceeds_capacity")
    spans = await spans_of(stack.traces, trace_id, lambda s: len(s) >= 2)
    http, admission = one(spans, "POST /v1/sessions"), one(spans, "admission")
    assert admission.parent_span_id == http.span_id
    assert admission.attributes["kvgate.decision"] == "reject"
    assert admission.attributes["kvgate.reason"] == "exceeds_capacity"
    assert admission.attributes["kvgate.retry_after_s"] == resp.json()["retry_after"]
    assert admission.attributes["kvgate.need_tokens"] == 256 * 8000
    assert http.attributes["http.response.status_code"] == 503

    assert stack.api.log_path is not None
    lines = [json.loads(line) for line in stack.api.log_path.read_text().splitlines() if line]
    logged = [line for line in lines if line.get("trace_id") == trace_id]
    assert logged and "exceeds_capacity" in logged[0]["message"]
    assert logged[0]["span_id"] == admission.span_id and logged[0]["level"] == "info"


def test_the_grpc_exporter_delivers_spans_too() -> None:
    receiver = OtlpGrpcReceiver().start()
    try:
        script = (
            "from broker.telemetry import setup_tracing, shutdown_tracing, tracer\n"
            "assert setup_tracing('kvgate-api')\n"
            "with tracer().start_as_current_span('admission') as s:\n"
            "    s.set_attribute('kvgate.reason', 'admitted')\n"
            "shutdown_tracing()\n"
        )
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": "kvgate-api-grpc",
        }
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
        (span,) = receiver.store.spans
    finally:
        receiver.stop()
    assert (span.service, span.name, span.attributes) == (
        "kvgate-api-grpc",
        "admission",
        {"kvgate.reason": "admitted"},
    )


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(
    env: dict[str, str], wanted: bool
) -> None:
    assert tracing_wanted(env) is wanted
