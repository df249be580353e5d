"""Dependency aliases for routers.

The dependencies are ``async def`` although none awaits anything: FastAPI runs a plain
``def`` dependency in its thread pool, a thread hop per dependency on every request (measured
here: about a millisecond of time to first token on two busy cores).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

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


# The schemes name the headers for the OpenAPI document (FastAPI lists a route's security from
# its dependencies); with `auto_error=False` they only read them, and the dependency that
# takes them answers (401 in OpenAI's shape, never FastAPI's 403).
def bearer(scheme_name: str, description: str) -> HTTPBearer:
    """A security scheme reading ``Authorization: Bearer <token>``, for a dependency that checks
    the token itself."""
    return HTTPBearer(scheme_name=scheme_name, description=description, auto_error=False)


TENANT_KEY = bearer(
    "TenantKey",
    "A tenant's API key, as `Authorization: Bearer <key>`; the tenants file "
    "(`KVGATE_TENANTS_FILE`) holds its SHA-256. With no tenants file (development), every "
    "caller is the open development tenant and no key is needed.",
)
ANTHROPIC_KEY = APIKeyHeader(
    name="x-api-key",
    scheme_name="AnthropicKey",
    description="The same tenant key in `x-api-key`, where Anthropic's clients send it; read "
    "only when there is no `Authorization` header.",
    auto_error=False,
)


async def get_tenant(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(TENANT_KEY)],
    api_key: Annotated[str | None, Security(ANTHROPIC_KEY)],
) -> Tenant:
    """The tenant named by ``Authorization: Bearer <key>`` (or, with no ``Authorization``
    header, ``x-api-key``); 401 for a missing or unknown key (in development mode, with no
    tenants file, every caller is the open tenant)."""
    door = front_door_of(request)
    header = request.headers.get("authorization", "")
    given = bearer.credentials if bearer is not None else None
    if not header:
        given = api_key
    tenant = door.admitter.tenancy.authenticate(given)
    if tenant is None:
        raise Unauthorized(
            "missing or unknown API key: send 'Authorization: Bearer <key>'"
            if header
            else "missing API key: send 'Authorization: Bearer <key>'",
        )
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]
