"""Reading a request: the body's size limit every route applies, JSON objects, and the
``Idempotency-Key`` header.

Every route that takes a body reads it here rather than through FastAPI's body binding, so that
an oversized body is refused before it is read whole and malformed JSON gets its own code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request

from api.openapi import header
from broker.errors import BodyTooLarge, InvalidJson, InvalidParameter, InvalidRequest
from schemas.openai import INT64_MAX, INT64_MIN

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY = 255
IDEMPOTENCY_PARAMETER = header(
    IDEMPOTENCY_HEADER,
    {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY},
    "A key the client chooses: a repeated request with the same key (within the tenant) "
    "answers 200 with what the first one created instead of creating it again.",
)


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


# The integers a request may carry (``INT64_MIN``..``INT64_MAX``): vLLM reads every integer field
# (a seed, token ids) as a 64-bit one, and no field of OpenAI's or Anthropic's APIs needs more.


class IntegerOutOfRange(ValueError):
    """An integer in the body past 64 bits; ``path`` leads to it from the top (keys and list
    indexes), so that the error can name the field."""

    def __init__(self, path: tuple[str | int, ...], text: str) -> None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        number = text if len(text) <= 40 else f"an integer of {len(text.lstrip('-'))} digits"
        super().__init__(f"{where or 'body'}: {number} is outside the 64-bit integer range")
        self.path = path


class _OutOfRange:
    """Stands in for an integer past 64 bits while the body is read: converting it (Python
    refuses past 4,300 digits) or passing it on (vLLM overflows) is left to nobody."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _in_range(text: str) -> int | _OutOfRange:
    if len(text.lstrip("-")) > 19:  # 2**63 has 19 digits: longer is out of range, unconverted
        return _OutOfRange(text)
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else _OutOfRange(text)


def _path_to_out_of_range(value: Any) -> tuple[tuple[str | int, ...], str] | None:
    # Iterative: the body may nest as deep as json reads, past what recursion here allows.
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, _OutOfRange):
            return path, item.text
        if isinstance(item, dict):
            pending.extend(((*path, k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend(((*path, i), v) for i, v in reversed(list(enumerate(item))))
    return None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


_LONG_DIGITS = re.compile(r"[0-9]{19}")
_LONG_DIGITS_BYTES = re.compile(rb"[0-9]{19}")
"""19 digits in a row: without them (the usual body), no integer can be past 64 bits."""


def _loads(text: str | bytes, parse_int: Callable[[str], Any]) -> Any:
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite, parse_int=parse_int)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` held to RFC 8259: Python's also reads ``NaN`` and ``Infinity``, and turns
    a number past the float range into infinity, none of which a caller can mean and all of
    which the body would carry unchanged to the engine's sampling parameters. Integers past 64
    bits are refused too (``IntegerOutOfRange``, naming where), and so is nesting deeper than
    Python's recursion limit. Raises ``ValueError`` (``json.JSONDecodeError`` for malformed
    text) or ``UnicodeDecodeError``."""
    long_digits = _LONG_DIGITS_BYTES if isinstance(text, bytes) else _LONG_DIGITS
    if long_digits.search(text) is None:  # type: ignore[arg-type]
        # Integers converted in C, not one Python call each (a prompt of token ids has
        # thousands).
        return _loads(text, int)
    seen: list[_OutOfRange] = []

    def parse_int(digits: str) -> int | _OutOfRange:
        value = _in_range(digits)
        if isinstance(value, _OutOfRange):
            seen.append(value)
        return value

    value = _loads(text, parse_int)
    if seen:
        found = _path_to_out_of_range(value)
        assert found is not None
        raise IntegerOutOfRange(*found)
    return value


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``invalid_json`` / ``invalid_request``; an integer past
    64 bits is ``invalid_parameter`` naming the top-level field it is in."""
    try:
        raw: Any = loads_json(body)
    except IntegerOutOfRange as exc:
        field = exc.path[0] if exc.path and isinstance(exc.path[0], str) else None
        raise InvalidParameter(str(exc), param=field) from None
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
