"""Turn a batch submission (a JSON body or a JSONL upload) into validated lines, reporting each
bad line with its number, ``custom_id`` and reason instead of refusing the whole batch.

The line limit is checked before any line is parsed: a parsed line costs some hundreds of bytes
however short its text, so a body of tiny lines parsed first would cost far more memory than
its size. Parsing is CPU-bound and blocking; the front door runs it in a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from fastapi import Request

from api.bodies import IntegerOutOfRange, loads_json, parse_json_object
from api.chat_request import check_known_model, parse_chat_request
from broker.errors import InvalidParameter, InvalidRequest, InvalidTier
from broker.settings import ApiSettings
from schemas.vocab import ErrorCode, Tier

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/x-jsonlines")
CHAT_URL = "/v1/chat/completions"
MIN_WINDOW_S, MAX_WINDOW_S = 3600, 24 * 3600
_WINDOW = re.compile(r"^(\d+)(h|m)$")
_NOT_BLANK = re.compile(r"\S")

BATCH_OPTIONS_SCHEMA: dict[str, Any] = {
    "completion_window": {
        "type": "string",
        "pattern": _WINDOW.pattern,
        "default": "24h",
        "description": "From '1h' to '24h'.",
    },
    "tier": {"type": "string", "enum": [tier.value for tier in Tier], "default": "besteffort"},
}
BATCH_BODY_SCHEMA: dict[str, Any] = {
    "title": "BatchCreate",
    "type": "object",
    "description": "The batch's lines (`requests`), or OpenAI's flow: a JSONL file uploaded "
    "before (`input_file_id`). A line that is not valid fails alone.",
    "anyOf": [{"required": ["requests"]}, {"required": ["input_file_id"]}],
    "properties": {
        "requests": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["custom_id", "body"],
                "properties": {
                    "custom_id": {"type": "string", "minLength": 1, "maxLength": 255},
                    "url": {"type": "string", "enum": [CHAT_URL]},
                    "session": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 255,
                        "description": "Lines naming one session run in order (defaults to "
                        "`custom_id`).",
                    },
                    "parallel": {"type": "boolean", "default": False},
                    "body": {"type": "object", "description": "A chat completions request."},
                },
            },
        },
        "input_file_id": {"type": "string"},
        "endpoint": {"type": "string", "enum": [CHAT_URL]},
        "metadata": {"type": "object"},
        **BATCH_OPTIONS_SCHEMA,
    },
}
"""What ``parse_submission`` reads of a JSON body, for the OpenAPI document."""


@dataclass(frozen=True, slots=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "custom_id": self.custom_id,
            "code": self.code,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class ParsedLine:
    line: int
    custom_id: str
    session_key: str
    parallel: bool
    body: dict[str, Any]
    error: LineError | None = None


@dataclass(frozen=True, slots=True)
class BatchSubmission:
    completion_window_s: int
    tier: Tier | None
    metadata: dict[str, Any]
    lines: list[ParsedLine]

    @property
    def errors(self) -> list[LineError]:
        return [line.error for line in self.lines if line.error is not None]


def completion_window_s(raw: object) -> int:
    match = _WINDOW.match(str(raw)) if isinstance(raw, str) else None
    seconds = 0
    if match:
        seconds = int(match.group(1)) * (3600 if match.group(2) == "h" else 60)
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise InvalidParameter(
            "completion_window must be between '1h' and '24h' (for example '24h' or '90m')",
            param="completion_window",
        )
    return seconds


def batch_tier(raw: object) -> Tier | None:
    if raw is None:
        return None
    try:
        return Tier(str(raw).strip().lower())
    except ValueError:
        names = ", ".join(t.value for t in Tier)
        raise InvalidTier(f"unknown tier {raw!r}; tiers are {names}", param="tier") from None


def is_jsonl(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() in JSONL_TYPES


def parse_submission(
    request: Request,
    body: bytes,
    settings: ApiSettings,
    models: Collection[str],
    obj: dict[str, Any] | None = None,
) -> BatchSubmission:
    """A batch from its JSON body (``obj``, if the caller parsed it already) or JSONL upload;
    a line naming a model outside ``models`` fails alone."""
    params = request.query_params
    if is_jsonl(request):
        text = body.decode("utf-8", errors="replace")
        raw_lines: list[object] = jsonl_lines(text, settings.batch_max_lines)
        options: dict[str, Any] = dict(params)
        metadata: dict[str, Any] = {}
    else:
        obj = parse_json_object(body) if obj is None else obj
        requests = obj.get("requests")
        if not isinstance(requests, list):
            raise InvalidRequest(
                "'requests' must be a list of batch lines (or upload JSONL with "
                "content-type application/jsonl)",
                param="requests",
            )
        raw_lines = requests
        options = {**dict(params), **obj}
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise InvalidParameter("metadata must be an object", param="metadata")
    return parse_lines(raw_lines, options, metadata, settings, models)


def parse_file_submission(
    content: bytes, options: dict[str, Any], settings: ApiSettings, models: Collection[str]
) -> BatchSubmission:
    """A batch made from an uploaded JSONL file (OpenAI's flow: ``input_file_id``)."""
    metadata = options.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidParameter("metadata must be an object", param="metadata")
    text = content.decode("utf-8", errors="replace")
    raw_lines: list[object] = jsonl_lines(text, settings.batch_max_lines)
    return parse_lines(raw_lines, options, metadata, settings, models)


def jsonl_lines(text: str, limit: int) -> list[object]:
    """The first ``limit + 1`` lines of a JSONL text that are not blank, so that the caller can
    tell a text past the limit without holding every line of it: blank lines are skipped
    without being copied, however many there are."""
    return list(islice(_not_blank_lines(text), limit + 1))


def _not_blank_lines(text: str) -> Iterator[str]:
    # Blank means what ``str.strip`` removes: regex ``\S`` is exactly its complement.
    pos = 0
    while (found := _NOT_BLANK.search(text, pos)) is not None:
        start = text.rfind("\n", pos, found.start()) + 1
        end = text.find("\n", found.start())
        end = len(text) if end < 0 else end
        yield text[start:end]
        pos = end


def parse_lines(
    raw_lines: list[object],
    options: dict[str, Any],
    metadata: dict[str, Any],
    settings: ApiSettings,
    models: Collection[str],
) -> BatchSubmission:
    window = completion_window_s(options.get("completion_window", "24h"))
    tier = batch_tier(options.get("tier"))
    # Counted before any line is parsed (see the module docstring).
    count = sum(1 for raw in raw_lines if not _blank(raw))
    if not count:
        raise InvalidRequest("the batch has no lines")
    if count > settings.batch_max_lines:
        raise InvalidRequest(
            f"a batch may have at most {settings.batch_max_lines} lines",
        )
    lines: list[ParsedLine] = []
    seen: set[str] = set()
    for raw in raw_lines:
        if not _blank(raw):
            lines.append(_parse_line(len(lines) + 1, raw, seen, settings, models))
    return BatchSubmission(window, tier, metadata, lines)


def _blank(raw: object) -> bool:
    """A blank line of a JSONL file, skipped without a line number."""
    return isinstance(raw, str) and not raw.strip()


def _parse_line(
    number: int, raw: object, seen: set[str], settings: ApiSettings, models: Collection[str]
) -> ParsedLine:
    custom_id: str | None = None

    def bad(code: ErrorCode, message: str) -> ParsedLine:
        error = LineError(number, custom_id, code.value, message)
        cid = custom_id if custom_id is not None and custom_id not in seen else None
        key = cid or f"__invalid_line_{number}"
        seen.add(key)
        return ParsedLine(number, key, key, False, {}, error)

    if isinstance(raw, str):
        text = raw
        try:
            raw = loads_json(text)
        except IntegerOutOfRange as exc:
            # Refused by name, but the line is JSON: its custom_id still names its result.
            with contextlib.suppress(ValueError):
                whole = json.loads(text)
                named = whole.get("custom_id") if isinstance(whole, dict) else None
                custom_id = named if isinstance(named, str) and 0 < len(named) <= 255 else None
            return bad(ErrorCode.INVALID_PARAMETER, str(exc))
        except ValueError as exc:
            return bad(ErrorCode.INVALID_JSON, f"line is not valid JSON: {exc}")
    if not isinstance(raw, dict):
        return bad(ErrorCode.INVALID_REQUEST, "a line must be a JSON object")
    cid = raw.get("custom_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= 255:
        return bad(ErrorCode.INVALID_PARAMETER, "custom_id must be a string of 1-255 characters")
    custom_id = cid
    if cid in seen:
        custom_id = cid
        error = LineError(number, cid, ErrorCode.INVALID_PARAMETER.value, "duplicate custom_id")
        key = f"__duplicate_line_{number}"
        seen.add(key)
        return ParsedLine(number, key, key, False, {}, error)
    seen.add(cid)
    url = raw.get("url", CHAT_URL)
    if url != CHAT_URL:
        return _invalid(number, cid, ErrorCode.INVALID_PARAMETER, f"url must be {CHAT_URL}")
    session = raw.get("session", cid)
    if not isinstance(session, str) or not 0 < len(session) <= 255:
        return _invalid(number, cid, ErrorCode.INVALID_PARAMETER, "session must be a string")
    body = raw.get("body")
    if not isinstance(body, dict):
        return _invalid(number, cid, ErrorCode.INVALID_REQUEST, "body must be a JSON object")
    try:
        chat = parse_chat_request(json.dumps(body).encode(), settings)
        check_known_model(chat.model, models)
    except InvalidRequest as exc:
        return _invalid(number, cid, exc.code, exc.message)
    if chat.stream:
        return _invalid(number, cid, ErrorCode.UNSUPPORTED_PARAMETER, "stream is not allowed")
    return ParsedLine(number, cid, session, bool(raw.get("parallel", False)), body)


def _invalid(number: int, custom_id: str, code: ErrorCode, message: str) -> ParsedLine:
    error = LineError(number, custom_id, code.value, message)
    return ParsedLine(number, custom_id, custom_id, False, {}, error)
