"""``/dashboard``: the live operator page, behind the admin token.

Signing in: the page's form posts the token once (``POST /dashboard/login``); the answer sets
a cookie, HttpOnly and SameSite=Strict (Secure over HTTPS), scoped to ``/dashboard``, and the
token never appears in a URL, where logs and browser history would keep it. The cookie holds
an HMAC of the token, not the token itself: a cookie that leaks opens this page, not the admin
API, and changing the token signs every browser out.

Without a valid cookie ``GET /dashboard`` is the sign-in form, and the data route answers 401
in the OpenAI error shape (it also takes ``Authorization: Bearer <token>``, for scripts).

The page polls ``/dashboard/history`` every sampling interval for the samples it lacks. Polling
rather than server-sent events: a page left open would otherwise hold a connection that keeps
the front door from shutting down gracefully, and each poll is a read of memory (the ring in
``api.dashboard``), never of NATS.

These routes are left out of the OpenAPI document: they serve a browser page (HTML, a cookie),
not a client API. ``/v1/admin/*`` and ``/metrics`` are the documented ways to the same data.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from api.bodies import read_body
from api.dashboard import HISTORY_S, LATENCY_WINDOW_S
from api.deps import FrontDoorDep, SettingsDep
from api.routes.admin import is_admin_token
from broker.errors import NotFound, Unauthorized
from broker.settings import ApiSettings

COOKIE = "kvgate_dashboard"
COOKIE_PATH = "/dashboard"
COOKIE_MAX_AGE_S = 12 * 3600
_COOKIE_CONTEXT = b"kvgate dashboard session v1"
_LOGIN_BODY_LIMIT = 4096
STATIC = Path(__file__).resolve().parents[1] / "static" / "dashboard"
_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
"""Every file the page loads, and nothing else under ``STATIC`` (no path is ever joined from
the request)."""

_PAGE_HEADERS = {
    # Everything comes from this front door: no CDN, no inline script, no framing.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/dashboard", include_in_schema=False)


def session_value(token: str, issued_s: int) -> str:
    """The cookie's value for ``token``, signed in at ``issued_s`` (unix seconds): the time is
    signed with it, so that a copied cookie stops working when its age passes
    ``COOKIE_MAX_AGE_S`` whatever the browser was told."""
    mac = hmac.new(token.encode(), _COOKIE_CONTEXT + b"%d" % issued_s, hashlib.sha256)
    return f"{issued_s}.{mac.hexdigest()}"


def valid_cookie(cookie: str, token: str, now_s: float) -> bool:
    """Whether ``cookie`` was signed in with ``token`` within ``COOKIE_MAX_AGE_S``."""
    issued, _, _ = cookie.partition(".")
    if not issued.isdigit() or not 0 <= now_s - int(issued) <= COOKIE_MAX_AGE_S:
        return False
    return is_admin_token(session_value(token, int(issued)), cookie.encode())


def signed_in(request: Request, settings: ApiSettings) -> bool:
    """A valid dashboard cookie, or the admin token itself as a bearer token."""
    expected = settings.admin_token
    if not expected:
        return False
    cookie = request.cookies.get(COOKIE)
    if cookie is not None and valid_cookie(cookie, expected, time.time()):
        return True
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and is_admin_token(expected, credentials.encode("latin-1"))


async def require_viewer(request: Request, settings: SettingsDep) -> None:
    if not signed_in(request, settings):
        raise Unauthorized(
            "the dashboard needs its sign-in cookie (POST /dashboard/login) or "
            "'Authorization: Bearer <KVGATE_ADMIN_TOKEN>'"
            + ("" if settings.admin_token else " (no admin token is configured on this server)")
        )


ViewerDep = Annotated[None, Depends(require_viewer)]


@functools.cache
def _file(name: str) -> bytes:
    """A file of ``STATIC``, read once: no request reads the disk on the event loop."""
    return (STATIC / name).read_bytes()


def _page(name: str, status: int = 200, message: str = "") -> HTMLResponse:
    html = _file(name).decode()
    if message:
        # Only fixed text of this module's own reaches the page: nothing the caller sent.
        html = html.replace("<!--message-->", f'<p class="message" role="alert">{message}</p>')
    return HTMLResponse(html, status, headers=_PAGE_HEADERS)


@router.get("")
async def dashboard(request: Request, settings: SettingsDep) -> HTMLResponse:
    if signed_in(request, settings):
        return _page("dashboard.html")
    if not settings.admin_token:
        return _page("login.html", 401, "No admin token is configured (KVGATE_ADMIN_TOKEN).")
    return _page("login.html")


@router.post("/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    form = parse_qs((await read_body(request, _LOGIN_BODY_LIMIT)).decode("utf-8", "replace"))
    token = form.get("token", [""])[0]
    expected = settings.admin_token
    if expected is None or not is_admin_token(expected, token.encode()):
        return _page("login.html", 401, "That is not this front door's admin token.")
    # 303: the browser follows with a GET, so a reload does not post the token again.
    response = RedirectResponse(COOKIE_PATH, status_code=303, headers=_PAGE_HEADERS)
    response.set_cookie(
        COOKIE,
        session_value(expected, int(time.time())),
        max_age=COOKIE_MAX_AGE_S,
        path=COOKIE_PATH,
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse(COOKIE_PATH, status_code=303, headers=_PAGE_HEADERS)
    response.delete_cookie(
        COOKIE,
        path=COOKIE_PATH,
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.get("/history")
async def history(
    door: FrontDoorDep, _: ViewerDep, after: Annotated[int, Query(ge=-1)] = -1
) -> Response:
    """The samples after ``after`` (a sample's ``seq``), with the workers as last sampled; a
    page whose ``epoch`` differs from the one it saw must start again (a restarted front door
    counts its samples from 1 again)."""
    sampler = door.dashboard
    body: dict[str, Any] = {
        "epoch": sampler.epoch,
        "interval_s": sampler.interval_s,
        "history_s": HISTORY_S,
        "latency_window_s": LATENCY_WINDOW_S,
        "heartbeat_max_age_s": door.settings.heartbeat_max_age_s,
        "objectives": sampler.objectives,
        "workers": sampler.workers,
        "samples": sampler.history.after(after),
    }
    return Response(
        msgspec.json.encode(body),
        media_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


@router.get("/static/{name}")
async def asset(name: str) -> Response:
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no dashboard asset {name!r}")
    return Response(
        _file(name),
        media_type=media_type,
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )
