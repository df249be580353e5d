"""Liveness and readiness.

``/healthz`` answers while the process runs. ``/readyz`` answers 200 only when a call could be
served now: NATS connected, the calls stream present, and at least one live, non-draining
worker heartbeat. Otherwise 503 with what is missing, so a load balancer and a person both see
why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from nats.js.errors import Error as JetStreamError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import FrontDoorDep
from api.openapi import error_responses
from schemas.wire import STREAM_NAME

router = APIRouter(tags=["health"])

_STREAM_CHECK_S = 1.0
"""The longest /readyz waits for the calls stream to answer: a server that slow is not ready,
and a probe (a load balancer's, typically 1-5 s) must get its answer in time."""


_READINESS = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["status", "checks"],
                "properties": {
                    "status": {"type": "string", "enum": ["ready", "not_ready"]},
                    "checks": {"type": "object"},
                },
            }
        }
    }
}


PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class ProbeAccessFilter(logging.Filter):
    """Keeps health probes out of uvicorn's access log: a load balancer, an orchestrator or
    ``kvgate up`` asks several times a second, which buried every other line."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client address, method, path with query, HTTP version,
        # status).
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


@router.get("/healthz", responses=error_responses())
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=None,
    responses={
        200: {"description": "A call could be served now.", **_READINESS},
        503: {"description": "Not ready: `checks` says what is missing.", **_READINESS},
        **error_responses(),
    },
)
async def readyz(door: FrontDoorDep) -> JSONResponse:
    checks: dict[str, Any] = {"nats": door.nc.is_connected}
    if not checks["nats"]:
        # Asked while reconnecting, the server would only answer after the request's whole
        # timeout (5 s): a probe must hear "not ready" at once, and a slow one is no answer.
        checks["stream"] = False
        checks["stream_error"] = "not connected to NATS"
    else:
        try:
            async with asyncio.timeout(_STREAM_CHECK_S):
                await door.js.stream_info(STREAM_NAME)
            checks["stream"] = True
        except (JetStreamError, TimeoutError) as exc:
            checks["stream"] = False
            checks["stream_error"] = str(exc) or type(exc).__name__
    workers = door.fleet.serving(int(time.time() * 1000))
    checks["workers"] = len(workers)
    ready = bool(checks["nats"] and checks["stream"] and workers)
    body = {"status": "ready" if ready else "not_ready", "checks": checks}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"description": "Prometheus' text exposition format."},
        **error_responses(),
    },
)
async def metrics(door: FrontDoorDep) -> Response:
    return Response(generate_latest(door.metrics.registry), media_type=CONTENT_TYPE_LATEST)
