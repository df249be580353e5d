"""Dependency aliases for routers.

The dependencies are ``async def`` although none awaits anything: FastAPI runs a plain
``def`` dependency in its thread pool, a thread hop per dependency on every request (measured
here: about a millisecond of time to first token on two busy cores).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.frontdoor import FrontDoor
from broker.admission.tenants import Tenant
from broker.errors import Unauthorized
from broker.settings import ApiSettings


def front_door_of(request: Request) -> FrontDoor:
    front_door: FrontDoor = request.app.state.front_door
    return front_door


async def get_front_door(request: Request) -> FrontDoor:
    return front_door_of(request)


async def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


FrontDoorDep = Annotated[FrontDoor, Depends(get_front_door)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]


async def get_tenant(request: Request) -> Tenant:
    """The tenant named by ``Authorization: Bearer <key>``; 401 for a missing or unknown key
    (in development mode, with no tenants file, every caller is the open tenant)."""
    door = front_door_of(request)
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    given = key.strip() if scheme.lower() == "bearer" else None
    if not header:
        given = request.headers.get("x-api-key")  # Anthropic's clients send it there
    tenant = door.admitter.tenancy.authenticate(given)
    if tenant is None:
        raise Unauthorized(
            "missing or unknown API key: send 'Authorization: Bearer <key>'"
            if header
            else "missing API key: send 'Authorization: Bearer <key>'",
        )
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]
