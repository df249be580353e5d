"""Reading a request: the body's size limit every route applies, JSON objects, and the
``Idempotency-Key`` header.

Every route that takes a body reads it here rather than through FastAPI's body binding, so that
an oversized body is refused before it is read whole and malformed JSON gets its own code.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from broker.errors import BodyTooLarge, InvalidJson, InvalidParameter, InvalidRequest

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY = 255


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes without reading past it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> InvalidRequest:
    return BodyTooLarge(f"request body exceeds {limit} bytes")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` held to RFC 8259: Python's also reads ``NaN`` and ``Infinity``, and turns
    a number past the float range into infinity, none of which a caller can mean and all of
    which the body would carry unchanged to the engine's sampling parameters. Raises
    ``ValueError`` (``json.JSONDecodeError`` for malformed text) or ``UnicodeDecodeError``."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``invalid_json`` / ``invalid_request``."""
    try:
        raw: Any = loads_json(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidJson(f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("request body must be a JSON object")
    return raw


def idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key``, or None; ``invalid_parameter`` unless it is 1-255
    printable characters (the length the session and batch tables store)."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isprintable()):
        raise InvalidParameter(
            f"{IDEMPOTENCY_HEADER} must be 1-{MAX_IDEMPOTENCY_KEY} printable characters",
            param=IDEMPOTENCY_HEADER,
        )
    return key
