"""What tracing costs per call: the span work kvgate does for one call (front door: admission,
publish with header injection, stream; worker: context extraction, queue_wait, fetch,
generate, two events), timed in-process with tracing off (OpenTelemetry's no-op tracer, as
when no OTLP endpoint is set) and on (the SDK with a batch processor and an exporter that
drops what it is given, so no network is timed).

Run: ``.venv/bin/python -m loadtests.bench_tracing --out loadtests/results/tracing.json``
(a few seconds). Each mode runs in a fresh interpreter, since a tracer provider can be set
only once per process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from loadtests import stats


class _DropExporter(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def one_call() -> None:
    from broker.telemetry import extract_context, inject_headers, tracer

    t = tracer()
    parent = otel_context.get_current()
    with t.start_as_current_span("admission") as span:
        if span.is_recording():
            span.set_attributes({"kvgate.decision": "admit", "kvgate.reason": "admitted"})
    publish = t.start_span("publish", context=parent, attributes={"kvgate.tier": "standard"})
    headers = inject_headers({}, trace.set_span_in_context(publish, parent))
    publish.end()
    stream = t.start_span("stream", context=parent)
    # The worker's side.
    context = extract_context(headers)
    for name in ("queue_wait", "fetch"):
        t.start_span(name, context=context).end()
    generate = t.start_span("generate", context=context)
    generate.add_event("first_token")
    generate.end()
    stream.add_event("first_token")
    stream.end()


def run(mode: str, calls: int) -> dict[str, Any]:
    if mode == "on":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from broker.telemetry import install_provider

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(_DropExporter()))
        install_provider(provider)
    for _ in range(1000):
        one_call()  # warm-up
    timings = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        one_call()
        timings.append((time.perf_counter_ns() - started) / 1000)
    cuts = stats.summary(timings, (50, 99), ndigits=2)
    return {"mode": mode, "calls": calls, "p50_us": cuts["p50"], "p99_us": cuts["p99"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/tracing.json"))
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--mode", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child run
        print(json.dumps(run(args.mode, args.calls)))
        return
    results = []
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-m", "loadtests.bench_tracing", "--mode", mode,
             "--calls", str(args.calls)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        results.append(json.loads(out))
        print(out.strip(), file=sys.stderr)
    report = {
        "command": "python -m loadtests.bench_tracing " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "per_call": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
