"""The console's routes: the page (`GET /console`), login and logout, its
JSON reads under `/console/api/`, and its static files.

Every read needs an admin session (the cookie set by the login form) or,
for scripts, the admin key as a Bearer token, as the admin routes do. On an
open server (no key at all) the console is open like the admin routes.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from engine_adapter.errors import GatewayError
from server.auth import Principal, require_admin
from server.console.history import History, Recent
from server.console.ledger import ledger_usage
from server.console.overview import overview
from server.console.sessions import COOKIE, Sessions
from server.state import GatewayDep

PAGES = Path(__file__).resolve().parent / "pages"
STATIC = Path(__file__).resolve().parent / "static"
MAX_LOGIN_BODY = 4096

# The page runs only the console's own files: no inline script, nothing
# from another origin, never framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(include_in_schema=False)


def sessions_of(request: Request) -> Sessions:
    s: Sessions = request.app.state.console.sessions
    return s


async def console_admin(request: Request) -> Principal:
    """The console's session, else the admin key (`require_admin`)."""
    p = sessions_of(request).from_request(request)
    return p if p is not None else await require_admin(request)


ConsoleDep = Annotated[Principal, Depends(console_admin)]


def _page(name: str, status: int = 200, error: str | None = None) -> HTMLResponse:
    text = (PAGES / name).read_text(encoding="utf-8")
    if error is not None:
        text = text.replace("<!--error-->", f'<p class="error" id="login-error" role="alert">{html.escape(error)}</p>')
    return HTMLResponse(text, status_code=status, headers=SECURITY_HEADERS)


@router.get("/console")
async def page(request: Request) -> HTMLResponse:
    try:
        await console_admin(request)
    except GatewayError:
        return _page("login.html")
    return _page("index.html")


@router.post("/console/login")
async def login(request: Request) -> Response:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            return _page("login.html", 413, "request too large")
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    key = (fields.get("key") or [""])[0].strip()
    token = sessions_of(request).login(request.app.state.keys, key)
    if token is None:
        return _page("login.html", 401, "That is not an admin key of this gateway.")
    resp = RedirectResponse("/console", status_code=303, headers={"Cache-Control": "no-store"})
    resp.set_cookie(
        COOKIE, token, max_age=int(sessions_of(request).ttl), path="/", httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )
    return resp


@router.post("/console/logout")
async def logout(request: Request) -> Response:
    sessions_of(request).logout(request.cookies.get(COOKIE))
    resp = RedirectResponse("/console", status_code=303, headers={"Cache-Control": "no-store"})
    resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return resp


def _json(body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


@router.get("/console/api/overview")
async def api_overview(request: Request, gw: GatewayDep, admin: ConsoleDep) -> JSONResponse:
    return _json(overview(gw, getattr(request.app.state, "device_monitor", None)))


@router.get("/console/api/history")
async def api_history(request: Request, admin: ConsoleDep) -> JSONResponse:
    history: History = request.app.state.console.history
    return _json(history.series())


@router.get("/console/api/usage")
async def api_usage(
    request: Request,
    admin: ConsoleDep,
    since: Annotated[str, Query(alias="from", max_length=64)],
    until: Annotated[str, Query(alias="to", max_length=64)],
) -> JSONResponse:
    """Usage per key and the keys' budgets, from the usage ledger's own
    admin endpoints (asked in process, with this request's credentials).
    Either answering 404 means the ledger is off: `{"ledger": "off"}`, not
    an error for the page to show in red."""
    return _json(await ledger_usage(request, since, until))


@router.get("/console/api/recent")
async def api_recent(
    request: Request, admin: ConsoleDep, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> JSONResponse:
    recent: Recent = request.app.state.console.recent
    return _json({"object": "list", "seen": recent.seen, "data": recent.items(limit)})
