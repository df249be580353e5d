"""``/v1/sessions``: admit, inspect and close agent sessions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from api.bodies import (
    IDEMPOTENCY_HEADER,
    IDEMPOTENCY_PARAMETER,
    idempotency_key,
    parse_json_object,
    read_body,
)
from api.chat_request import SESSION_HEADER
from api.deps import FrontDoorDep, TenantDep
from api.openapi import codes_below, error_responses, json_body, link
from broker.admission import needs
from broker.admission.state import SessionRecord
from broker.errors import InvalidParameter, InvalidTier, Refused
from schemas.sessions import SessionAdmission, SessionCreate, SessionLease, SessionOut
from schemas.vocab import Decision, ErrorCode, Reason, Tier

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

MAX_WAIT_SHARE_OF_DEADLINE = 0.5
"""A session held longer than this share of its deadline is left too little time to finish in
(the deadline check at admission assumes the fastest speed the fleet shows): answer instead."""
SESSION_EXAMPLE = {
    "tier": "standard",
    "max_parallel": 4,
    "expected_calls": 12,
    "est_prompt_tokens": 2000,
    "est_output_tokens": 300,
    "deadline_s": 600,
}
"""A body for the OpenAPI document: an agent that fans out four calls at a time, twelve in all."""
_BY_ID = {"session_id": "$response.body#/id"}
_IN_IT = {f"header.{SESSION_HEADER}": "$response.body#/id"}
_SESSION_LINKS = {
    "GetSession": link("GET", "/v1/sessions/{session_id}", "Inspect the session.", _BY_ID),
    "CloseSession": link("DELETE", "/v1/sessions/{session_id}", "Close the session.", _BY_ID),
    **{
        f"{name}InSession": link(
            "POST",
            path,
            "Run a call in the session.",
            _IN_IT,
        )
        for name, path in (
            ("Chat", "/v1/chat/completions"),
            ("Completion", "/v1/completions"),
            ("Message", "/v1/messages"),
        )
    },
}
_SESSION_RESPONSES = {
    200: {"model": SessionOut, "description": "The session."},
    **error_responses(
        ErrorCode.UNAUTHORIZED, ErrorCode.SESSION_NOT_FOUND, ErrorCode.ADMISSION_UNAVAILABLE
    ),
}


@router.post(
    "",
    openapi_extra={
        **json_body(SessionCreate, SESSION_EXAMPLE),
        "parameters": [IDEMPOTENCY_PARAMETER],
    },
    response_model=None,
    status_code=201,
    responses={
        200: {
            "model": SessionOut,
            "description": f"The session admitted before under this {IDEMPOTENCY_HEADER}.",
            "links": _SESSION_LINKS,
        },
        201: {"model": SessionOut, "description": "Admitted.", "links": _SESSION_LINKS},
        **error_responses(
            ErrorCode.INVALID_JSON,
            ErrorCode.INVALID_REQUEST,
            ErrorCode.INVALID_TIER,
            ErrorCode.INVALID_PARAMETER,
            ErrorCode.BODY_TOO_LARGE,
            ErrorCode.UNAUTHORIZED,
            ErrorCode.TIER_NOT_ALLOWED,
            *codes_below(Refused),
        ),
    },
)
async def create_session(request: Request, door: FrontDoorDep, tenant: TenantDep) -> JSONResponse:
    settings = door.settings
    body = parse_session_create(await read_body(request, settings.max_body_bytes))
    need = needs.for_session(body, tenant, door.admitter.tenancy, settings)
    max_wait_s = body.max_wait_s
    if max_wait_s is None:
        max_wait_s = settings.admission_max_wait_s
    elif max_wait_s > settings.admission_max_wait_s:
        raise InvalidParameter(
            f"max_wait_s must be at most {settings.admission_max_wait_s:g}",
            param="max_wait_s",
        )
    key = idempotency_key(request)
    admitted = await door.admitter.admit(
        tenant,
        need,
        scope="session",
        idle_timeout_s=body.idle_timeout_s or settings.session_default_idle_timeout_s,
        metadata=dict(body.metadata),
        idempotency_key=key,
        max_wait_s=min(max_wait_s, need.deadline_s * MAX_WAIT_SHARE_OF_DEADLINE),
    )
    reason = Reason.ADMITTED_DEGRADED if admitted.degraded else Reason.ADMITTED
    admission = SessionAdmission(
        decision=Decision.ADMIT, reason=reason, requested_parallel=body.max_parallel
    )
    out = session_out(admitted.record, admission)
    return JSONResponse(out.model_dump(mode="json"), status_code=200 if admitted.existing else 201)


@router.get("/{session_id}", responses=_SESSION_RESPONSES)
async def get_session(session_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    record = await door.leases.get(tenant, session_id)
    return session_out(record).model_dump(mode="json")


@router.delete("/{session_id}", responses=_SESSION_RESPONSES)
async def close_session(session_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    record = await door.leases.close(tenant, session_id)
    return session_out(record).model_dump(mode="json")


def parse_session_create(raw_body: bytes) -> SessionCreate:
    raw = parse_json_object(raw_body)
    if "tier" not in raw:
        names = ", ".join(t.value for t in Tier)
        raise InvalidTier(f"'tier' is required ({names})", param="tier")
    try:
        return SessionCreate.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        invalid = InvalidTier if field == "tier" else InvalidParameter
        raise invalid(f"{field or 'body'}: {first['msg']}", param=field) from None


def session_out(record: SessionRecord, admission: SessionAdmission | None = None) -> SessionOut:
    return SessionOut(
        id=record.id,
        tenant=record.tenant,
        tier=record.tier,
        state=record.state,
        created_at=record.created_ms / 1000,
        ended_at=None if record.ended_ms is None else record.ended_ms / 1000,
        expected_calls=record.expected_calls,
        est_prompt_tokens=record.est_prompt_tokens,
        est_output_tokens=record.est_output_tokens,
        idle_timeout_s=record.idle_timeout_ms / 1000,
        calls_started=record.calls_started,
        metadata=record.metadata,
        lease=SessionLease(
            reserved_tokens=record.reserved_tokens,
            max_parallel=record.max_parallel,
            expires_at=record.expires_ms / 1000,
            deadline_at=record.deadline_ms / 1000,
        ),
        admission=admission,
    )
