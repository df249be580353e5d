"""Tracing and structured logs for every kvgate process.

Tracing is configured from the standard OpenTelemetry environment variables and is off unless
an OTLP endpoint is named (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or ``OTEL_TRACES_EXPORTER=otlp`` is set; with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` it stays off. Off, the tracer is
OpenTelemetry's no-op one: a span is one call that returns a shared object, and nothing is
exported. On, spans go through a ``BatchSpanProcessor`` (its ``OTEL_BSP_*`` variables apply)
to the OTLP exporter of ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``http/protobuf`` (the
default, port 4318) or ``grpc`` (port 4317). ``OTEL_SERVICE_NAME`` overrides the process's
service name (``kvgate-api``, ``kvgate-worker``).

Trace context crosses processes in NATS message headers (``traceparent``, ``tracestate``):
``inject_headers`` on the publishing side, ``extract_context`` on the receiving side.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

TRACER_NAME = "kvgate"

_provider: TracerProvider | None = None


def tracing_wanted(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter == "otlp":
        return True
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: use 'http/protobuf' or 'grpc'")


def setup_tracing(service_name: str) -> bool:
    """Install the global tracer provider when tracing is wanted; returns whether it is on."""
    global _provider
    if _provider is not None or not tracing_wanted():
        return _provider is not None
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(os.environ)))
    install_provider(provider)
    return True


def install_provider(provider: TracerProvider) -> None:
    """Make ``provider`` the process's tracer provider (once per process)."""
    global _provider
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing() -> None:
    """Export what is buffered (call at exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


# A proxy: it hands out no-op spans until a provider is installed, real ones after.
_TRACER = trace.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    return _TRACER


def inject_headers(
    headers: dict[str, str], context: otel_context.Context | None = None
) -> dict[str, str]:
    """Add ``traceparent``/``tracestate`` of ``context`` (default: the current one) to NATS
    headers, in place. Nothing is added when tracing is off."""
    if _provider is not None:
        propagate.inject(headers, context=context)
    return headers


_EMPTY_CONTEXT = otel_context.Context()


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    if _provider is None:  # off: there is no span to join, so nothing to parse
        return _EMPTY_CONTEXT
    return propagate.extract(dict(headers or {}))


def ns_from_ms(unix_ms: int) -> int:
    return unix_ms * 1_000_000


def now_ns() -> int:
    return time.time_ns()


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line, with the trace and span ids of the span current when the
    record was logged (so a log line can be found from its trace, and the other way)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = f"{span.trace_id:032x}"
            entry["span_id"] = f"{span.span_id:016x}"
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str, fmt: str) -> None:
    """``fmt``: ``json`` (structured, the default for services) or ``text``."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
