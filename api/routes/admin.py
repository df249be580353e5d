"""Operator views: JetStream lag per tier and the live workers. Guarded by the admin token."""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Security
from fastapi.security import HTTPAuthorizationCredentials

from api.deps import FrontDoorDep, bearer
from api.openapi import error_responses
from broker.errors import Unauthorized
from broker.lag import fleet_lag
from schemas.vocab import ErrorCode

ADMIN_TOKEN = bearer(
    "AdminToken",
    "The operator's token (`KVGATE_ADMIN_TOKEN`), as `Authorization: Bearer <token>`; not a "
    "tenant key. With none configured, the admin routes answer 401.",
)


def is_admin_token(expected: str | None, given: bytes) -> bool:
    """Whether ``given`` is the configured admin token (never, with none configured), in
    constant time. Bytes, not text: compare_digest refuses text past ASCII (a token like that
    was a 500, not a 401)."""
    return bool(expected) and bool(given) and hmac.compare_digest(given, (expected or "").encode())


async def require_admin(
    door: FrontDoorDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(ADMIN_TOKEN)],
) -> None:
    expected = door.settings.admin_token
    # Header values arrive as Latin-1 text: compared as the bytes they were sent as.
    given = b"" if bearer is None else bearer.credentials.encode("latin-1")
    if not is_admin_token(expected, given):
        raise Unauthorized(
            "admin endpoints need 'Authorization: Bearer <KVGATE_ADMIN_TOKEN>'"
            + ("" if expected else " (no admin token is configured on this server)"),
        )


AdminDep = Annotated[None, Depends(require_admin)]
router = APIRouter(prefix="/v1/admin", tags=["admin"])
_ADMIN_ERRORS = error_responses(ErrorCode.UNAUTHORIZED)


@router.get("/lag", responses=_ADMIN_ERRORS)
async def lag(door: FrontDoorDep, _: AdminDep) -> dict[str, Any]:
    rows = await fleet_lag(door.js)
    return {"tiers": msgspec.to_builtins(rows)}


@router.get("/workers", responses=_ADMIN_ERRORS)
async def workers(door: FrontDoorDep, _: AdminDep) -> dict[str, Any]:
    """Every worker heard from in the last ten minutes; ``stale`` where its heartbeat is older
    than the front door's limit (it is given no work)."""
    now_ms = int(time.time() * 1000)
    return {
        "workers": [
            {
                **msgspec.to_builtins(hb),
                "age_s": (now_ms - hb.sent_ms) / 1000,
                "stale": now_ms - hb.sent_ms > door.fleet.max_age_ms,
            }
            for hb in sorted(door.fleet.recent(now_ms), key=lambda hb: hb.worker_id)
        ]
    }
