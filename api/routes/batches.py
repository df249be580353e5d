"""``/v1/batches``: submit a batch of session calls, follow it, collect its results."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.batches import files, store
from api.batches.request import (
    BATCH_BODY_SCHEMA,
    BATCH_OPTIONS_SCHEMA,
    CHAT_URL,
    JSONL_TYPES,
    ParsedLine,
    batch_tier,
    completion_window_s,
    is_jsonl,
    parse_file_submission,
    parse_submission,
)
from api.batches.results import results_file
from api.batches.store import (
    ENDED_BATCHES,
    UNANSWERED_LINES,
    BatchStatus,
    BatchView,
    LineStatus,
    error_file_id,
    output_file_id,
)
from api.bodies import (
    IDEMPOTENCY_HEADER,
    IDEMPOTENCY_PARAMETER,
    idempotency_key,
    parse_json_object,
    read_body,
)
from api.chat_request import CHAT_EXAMPLE
from api.deps import FrontDoorDep, TenantDep
from api.openapi import Responses, error_responses, link
from broker.db import utcnow
from broker.errors import BatchNotFound, InvalidRequest, NotFound, UnsupportedParameter
from schemas.vocab import ErrorCode, Tier

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BATCH_EXAMPLE = {
    "requests": [
        {
            "custom_id": f"q{n}",
            "body": {**CHAT_EXAMPLE, "messages": [{"role": "user", "content": q}]},
        }
        for n, q in enumerate(("Say hello.", "Count to three."), start=1)
    ],
    "completion_window": "24h",
}
"""A body for the OpenAPI document: two chat completions."""
_CREATE_BATCH_DOC = {
    "parameters": [
        {"name": name, "in": "query", "required": False, "schema": schema}
        for name, schema in BATCH_OPTIONS_SCHEMA.items()
    ]
    + [IDEMPOTENCY_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": BATCH_BODY_SCHEMA, "example": BATCH_EXAMPLE},
            JSONL_TYPES[0]: {"schema": {"type": "string", "description": "One batch line a line."}},
        },
    },
}
_BY_ID = {"batch_id": "$response.body#/id"}
_BATCH_LINKS = {
    "GetBatch": link("GET", "/v1/batches/{batch_id}", "Follow the batch.", _BY_ID),
    "CancelBatch": link("POST", "/v1/batches/{batch_id}/cancel", "Cancel the batch.", _BY_ID),
    "BatchResults": link(
        "GET", "/v1/batches/{batch_id}/results", "Collect the batch's results.", _BY_ID
    ),
}
_BATCH_RESPONSES: Responses = {
    200: {"description": "The batch."},
    **error_responses(ErrorCode.UNAUTHORIZED, ErrorCode.BATCH_NOT_FOUND),
}


@router.post(
    "",
    response_model=None,
    status_code=201,
    openapi_extra=_CREATE_BATCH_DOC,
    responses={
        200: {
            "description": f"The batch created before under this {IDEMPOTENCY_HEADER}.",
            "content": {"application/json": {"schema": {"type": "object"}}},
            "links": _BATCH_LINKS,
        },
        201: {
            "description": "The batch, created; `errors` lists its invalid lines.",
            "links": _BATCH_LINKS,
        },
        **error_responses(
            ErrorCode.INVALID_JSON,
            ErrorCode.INVALID_REQUEST,
            ErrorCode.INVALID_PARAMETER,
            ErrorCode.INVALID_TIER,
            ErrorCode.UNSUPPORTED_PARAMETER,
            ErrorCode.NOT_FOUND,
            ErrorCode.BODY_TOO_LARGE,
            ErrorCode.UNAUTHORIZED,
            ErrorCode.TIER_NOT_ALLOWED,
            ErrorCode.TOO_MANY_OPEN_BATCHES,
        ),
    },
)
async def create_batch(request: Request, door: FrontDoorDep, tenant: TenantDep) -> JSONResponse:
    settings = door.settings
    check_query_options(request)
    key = idempotency_key(request)
    if key is None:  # a retry under a key that made a batch gets that batch, not a refusal
        # Refused before a body of up to 64 MiB is read and parsed; counted again as it is stored.
        await asyncio.to_thread(
            store.check_open_batches, door.batch_engine, tenant.id, settings.batch_max_open
        )
    raw = await read_body(request, settings.max_body_bytes * 64)
    # Parsing a body of up to 64 times the call limit is seconds of CPU: never on the event loop.
    obj = None if is_jsonl(request) else await asyncio.to_thread(parse_json_object, raw)
    models = door.known_models()
    input_file_id: str | None = None
    if obj is not None and "input_file_id" in obj:
        # OpenAI's flow: the lines are in a file uploaded before (through any front door).
        input_file_id = str(obj["input_file_id"])
        endpoint = obj.get("endpoint", CHAT_URL)
        if endpoint != CHAT_URL:
            raise UnsupportedParameter(
                f"endpoint {endpoint!r} is not served in batches; use {CHAT_URL}",
                param="endpoint",
            )
        found = await asyncio.to_thread(
            files.read_file, door.batch_engine, tenant.id, input_file_id
        )
        if found is None:
            raise NotFound(f"no file {input_file_id!r}", param="input_file_id")
        options = {**request.query_params, **obj}
        submission = await asyncio.to_thread(
            parse_file_submission, found[1], options, settings, models
        )
    else:
        submission = await asyncio.to_thread(parse_submission, request, raw, settings, models, obj)
    tier = submission.tier or Tier.BESTEFFORT
    tenant.require_tier(tier)
    valid = [line for line in submission.lines if line.error is None]
    if not valid:
        raise InvalidRequest(
            f"every line of the batch is invalid; first: {submission.errors[0].message}",
        )
    now = utcnow()
    batch_id = f"batch_{uuid.uuid4().hex}"
    batch = {
        "id": batch_id,
        "tenant": tenant.id,
        "tier": tier.value,
        "status": BatchStatus.IN_PROGRESS.value,
        "completion_window_s": submission.completion_window_s,
        "created_at": now,
        "expires_at": now + timedelta(seconds=submission.completion_window_s),
        "finished_at": None,
        "cancel_requested": False,
        "total": len(submission.lines),
        "idempotency_key": key,
        "runner": None,
        "runner_seen_at": None,
        "metadata": submission.metadata,
        "input_file_id": input_file_id,
    }

    def create() -> tuple[store.BatchRow, bool]:
        rows = line_rows(batch_id, submission.lines, now)
        return store.create_batch(door.batch_engine, batch, rows, max_open=settings.batch_max_open)

    row, created = await asyncio.to_thread(create)
    view = await asyncio.to_thread(store.get_batch, door.batch_engine, tenant.id, row.id)
    assert view is not None
    body = batch_json(view)
    if created:
        body["errors"] = [e.to_json() for e in submission.errors]
        door.batch_runner.wake()
    return JSONResponse(body, status_code=201 if created else 200)


def check_query_options(request: Request) -> None:
    """400 for an option in the query that is not valid, even where the body names the same
    option (the body's is the one used): the document takes both, and the parsers read only the
    merged options, where a valid one in the body hid an invalid one in the query."""
    params = request.query_params
    if "completion_window" in params:
        completion_window_s(params["completion_window"])
    if "tier" in params:
        batch_tier(params["tier"])


def line_rows(batch_id: str, lines: list[ParsedLine], now: datetime) -> list[dict[str, Any]]:
    """The batch's lines as rows for ``store.create_batch``: as many as there are lines, so built
    in a worker thread, not on the event loop."""
    return [
        {
            "batch_id": batch_id,
            "line_no": line.line,
            "custom_id": line.custom_id,
            "session_key": line.session_key,
            "parallel": line.parallel,
            "body": line.body,
            # Invalid lines are failed from the start, so that they too have one result.
            "status": LineStatus.PENDING.value if line.error is None else LineStatus.FAILED.value,
            "call_id": store.line_call_id(batch_id, line.line),
            "started_at": None,
            "finished_at": None if line.error is None else now,
            "result": None
            if line.error is None
            else {"error": {"code": line.error.code, "message": line.error.message}},
            "error_code": None if line.error is None else line.error.code,
        }
        for line in lines
    ]


@router.get("", responses=error_responses(ErrorCode.INVALID_REQUEST, ErrorCode.UNAUTHORIZED))
async def list_batches(
    door: FrontDoorDep,
    tenant: TenantDep,
    after: str | None = None,
    limit: int = Query(default=20, ge=1, le=100),
) -> dict[str, Any]:
    views, more = await asyncio.to_thread(
        store.list_batches, door.batch_engine, tenant.id, after=after, limit=limit
    )
    data = [batch_json(v) for v in views]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.get("/{batch_id}", responses=_BATCH_RESPONSES)
async def get_batch(batch_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    return batch_json(await _view(door, tenant.id, batch_id))


@router.post("/{batch_id}/cancel", responses=_BATCH_RESPONSES)
async def cancel_batch(batch_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    await _view(door, tenant.id, batch_id)
    view = await asyncio.to_thread(store.request_cancel, door.batch_engine, tenant.id, batch_id)
    assert view is not None
    door.batch_runner.wake()
    return batch_json(view)


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "One JSON object a line: each line's `custom_id`, `status`, and its "
            "answer or error.",
            "content": {JSONL_TYPES[0]: {"schema": {"type": "string"}}},
        },
        **error_responses(ErrorCode.UNAUTHORIZED, ErrorCode.BATCH_NOT_FOUND),
    },
)
async def batch_results(batch_id: str, door: FrontDoorDep, tenant: TenantDep) -> StreamingResponse:
    await _view(door, tenant.id, batch_id)
    body = results_file(door.batch_engine, batch_id, door.settings.batch_page_lines)
    return StreamingResponse(body, media_type=JSONL_TYPES[0])


async def _view(door: FrontDoorDep, tenant: str, batch_id: str) -> BatchView:
    view = await asyncio.to_thread(store.get_batch, door.batch_engine, tenant, batch_id)
    if view is None:  # another tenant's batch is indistinguishable from none
        raise BatchNotFound(f"no batch {batch_id!r}")
    return view


def batch_json(view: BatchView) -> dict[str, Any]:
    b, counts = view.batch, view.counts
    ended = b.status in ENDED_BATCHES
    unanswered = sum(counts.get(s, 0) for s in UNANSWERED_LINES)
    finished = None if b.finished_at is None else int(b.finished_at.timestamp())
    body: dict[str, Any] = {
        "id": b.id,
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "status": b.status,
        "tier": b.tier,
        "completion_window": f"{b.completion_window_s // 3600}h"
        if b.completion_window_s % 3600 == 0
        else f"{b.completion_window_s // 60}m",
        "created_at": int(b.created_at.timestamp()),
        "expires_at": int(b.expires_at.timestamp()),
        "finished_at": finished,
        "request_counts": {"total": b.total, **counts},
        "metadata": b.metadata,
        # OpenAI's Batch object: the input file, and once the batch ended, its output and
        # error files (read from the lines: see api/routes/files.py).
        "input_file_id": b.input_file_id,
        "output_file_id": output_file_id(b.id) if ended and counts.get("completed") else None,
        "error_file_id": error_file_id(b.id) if ended and unanswered else None,
        "errors": None,
        "in_progress_at": int(b.created_at.timestamp()),
    }
    if ended and finished is not None:
        body[f"{b.status}_at"] = finished  # completed_at, expired_at, cancelled_at...
    return body
