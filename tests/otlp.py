"""A small OTLP receiver for tests: accepts trace exports over OTLP/HTTP (protobuf) or gRPC,
decodes them with the OpenTelemetry protobuf definitions, and keeps the spans."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status_code: int
    """0 unset, 1 ok, 2 error."""


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


@dataclass
class SpanStore:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, payload: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(payload)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name")),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=tuple(e.name for e in span.events),
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def where(self, **attributes: Any) -> list[ReceivedSpan]:
        with self._lock:
            return [
                s
                for s in self.spans
                if all(s.attributes.get(k) == v for k, v in attributes.items())
            ]


class OtlpHttpReceiver:
    """``POST /v1/traces`` with ``application/x-protobuf`` bodies, on a free loopback port."""

    def __init__(self) -> None:
        self.store = SpanStore()
        store = self.store

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                store.add(body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> OtlpHttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, store: SpanStore) -> None:
        self._store = store

    def Export(  # noqa: N802 - the gRPC service method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._store.add(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpGrpcReceiver:
    def __init__(self) -> None:
        self.store = SpanStore()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self.store), self._server
        )
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def start(self) -> OtlpGrpcReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)
