"""Reading a request: the body's size limit every route applies, JSON objects, and the
``Idempotency-Key`` header.

Every route that takes a body reads it here rather than through FastAPI's body binding, so that
an oversized body is refused before it is read whole and malformed JSON gets its own code.
"""

from __future__ import annotations

import json
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


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``invalid_json`` / ``invalid_request``."""
    try:
        raw: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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
