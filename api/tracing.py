"""The HTTP request span: a pure ASGI middleware, so that the span covers a streamed response
to its last byte (the stream back to the client is part of the request)."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.telemetry import extract_context, tracer


class RequestSpanMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        path = scope["path"]
        # An agent that traces its own work passes `traceparent`: kvgate's spans join it.
        context = extract_context(headers)
        with tracer().start_as_current_span(
            f"{method} {path}",
            context=context,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status: Any = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, str(status)))
                await send(message)

            await self.app(scope, receive, send_status)
