"""Errors to HTTP responses, in one place, in OpenAI's error shape.

Every error body is ``{"error": {"message", "type", "code", "param"}}``, plus ``retry_after``
(seconds, equal to the ``Retry-After`` header) where waiting helps. Nothing reaches a client as
a bare 500: an unexpected exception becomes ``internal_error`` and is logged with its trace.

Every kvgate error also carries ``x-should-retry: true`` where it carries ``Retry-After`` and
``false`` where it does not. The official OpenAI SDKs read that header before their own rule
(which retries every 429 and 5xx), so a plain ``openai`` client retries exactly the answers
where waiting helps, after the ``Retry-After`` kvgate named, and not, say, a session that
cannot finish by its deadline (``deadline_infeasible``) or a call kvgate already retried on
another worker.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match

from broker.errors import Cancelled, InternalError, InvalidRequest, KvgateError
from schemas.openai import AnthropicErrorBody, AnthropicErrorDetail, ErrorBody, ErrorDetail
from schemas.vocab import Endpoint, ErrorCode

log = logging.getLogger(__name__)

SHOULD_RETRY_HEADER = "x-should-retry"
"""Read by the official OpenAI SDKs (Python and TypeScript) before their default retry rule."""

STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.MISSING_MESSAGES: 400,
    ErrorCode.INVALID_MESSAGES: 400,
    ErrorCode.INVALID_MAX_TOKENS: 400,
    ErrorCode.MAX_TOKENS_TOO_LARGE: 400,
    ErrorCode.INVALID_PARAMETER: 400,
    ErrorCode.INVALID_TIER: 400,
    ErrorCode.UNSUPPORTED_PARAMETER: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.TIER_NOT_ALLOWED: 403,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.BATCH_NOT_FOUND: 404,
    ErrorCode.SESSION_CLOSED: 409,
    ErrorCode.SESSION_EXPIRED: 410,
    ErrorCode.CALL_EXCEEDS_SESSION: 400,
    ErrorCode.TENANT_QUOTA: 429,
    ErrorCode.TIER_CAPACITY: 503,
    ErrorCode.FLEET_SATURATED: 503,
    ErrorCode.DEADLINE_INFEASIBLE: 503,
    ErrorCode.EXCEEDS_CAPACITY: 503,
    ErrorCode.NO_WORKERS: 503,
    ErrorCode.DRAINING: 503,
    ErrorCode.ADMISSION_UNAVAILABLE: 503,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.ENGINE_ERROR: 502,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.BROKER_UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.TOO_MANY_WAITING_CALLS: 429,
    ErrorCode.TOO_MANY_OPEN_BATCHES: 429,
}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable_error"
    if status == 504:
        return "timeout_error"
    return "server_error"


def error_body(exc: KvgateError) -> ErrorBody:
    status = STATUS_BY_CODE[exc.code]
    return ErrorBody(
        error=ErrorDetail(
            message=exc.message, type=error_type(status), code=exc.code.value, param=exc.param
        ),
        retry_after=exc.retry_after,
        decision=exc.decision,
    )


# Anthropic's error types by HTTP status, for /v1/messages.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: KvgateError) -> AnthropicErrorBody:
    """Anthropic's error shape, with kvgate's code, param and retry_after beside, as in the
    OpenAI shape."""
    status = STATUS_BY_CODE[exc.code]
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return AnthropicErrorBody(
        error=AnthropicErrorDetail(
            type=kind, message=exc.message, code=exc.code.value, param=exc.param
        ),
        retry_after=exc.retry_after,
    )


def error_response(exc: KvgateError, request: Request | None = None) -> JSONResponse:
    """The error in the shape of the API the caller spoke: Anthropic's on /v1/messages,
    OpenAI's everywhere else."""
    headers = {SHOULD_RETRY_HEADER: "false"}
    if exc.retry_after is not None:
        headers = {SHOULD_RETRY_HEADER: "true", "Retry-After": str(exc.retry_after)}
    if request is not None and request.url.path == Endpoint.MESSAGES.path:
        return JSONResponse(
            anthropic_error_body(exc).to_json(), STATUS_BY_CODE[exc.code], headers=headers
        )
    return JSONResponse(error_body(exc).to_json(), STATUS_BY_CODE[exc.code], headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method the request's path takes. Starlette's 405 names only the first route that
    matched the path, where FastAPI makes one route per method (``GET`` and ``DELETE`` on
    ``/v1/sessions/{id}`` are two)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    async def on_kvgate_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KvgateError)
        return error_response(exc, request)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
        return error_response(
            InvalidRequest(
                str(first.get("msg", "invalid request")),
                param=".".join(loc) or None,
            ),
            request,
        )

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, ErrorCode.INVALID_REQUEST
        )
        status = exc.status_code if exc.status_code < 500 else 500
        body = ErrorBody(
            error=ErrorDetail(message=str(exc.detail), type=error_type(status), code=code.value)
        )
        headers = dict(exc.headers or {})
        if status == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return JSONResponse(body.to_json(), status, headers=headers)

    async def on_disconnect(_: Request, exc: Exception) -> JSONResponse:
        # The caller went away before its request was read (an agent giving up on a call at
        # its deadline does this): nothing was admitted or queued, and nobody reads the answer.
        log.debug("client disconnected before its request was read")
        return error_response(Cancelled("the client disconnected before its request was read"))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(InternalError("internal error"), request)

    app.add_exception_handler(KvgateError, on_kvgate_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
