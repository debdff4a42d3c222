"""/metrics and the admin routes (profiling)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from engine_adapter.errors import AuthenticationError, InvalidRequest
from server.auth import KeyStore, Principal, key_from_headers, require_admin
from server.routes.docs import ERRORS, TEXT
from server.state import GatewayDep

router = APIRouter()
AdminDep = Annotated[Principal, Depends(require_admin)]


@router.get("/metrics", tags=["ops"], responses=TEXT, response_class=Response)
async def metrics(request: Request) -> Response:
    keys: KeyStore = request.app.state.keys
    if not keys.metrics_allowed(key_from_headers(request)):
        raise AuthenticationError("/metrics needs the metrics API key")
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


async def _each_engine(gw: Any, method: str) -> int:
    n = 0
    for pool in gw.pools:
        if pool.relays or pool.card.kind != "generate":  # the generators are profiled, not the embedding engine
            continue
        for w in pool.workers:
            fn = getattr(w.engine, method, None)
            if fn is not None and w.alive:
                await fn()
                n += 1
    if not n:
        raise InvalidRequest("no engine here supports profiling")
    return n


@router.post("/start_profile", tags=["admin"], responses=ERRORS)
async def start_profile(gw: GatewayDep, admin: AdminDep) -> dict[str, Any]:
    n = await _each_engine(gw, "start_profile")
    return {"status": "profiling", "engines": n, "profile_dir": str(gw.settings.profile_dir)}


@router.post("/stop_profile", tags=["admin"], responses=ERRORS)
async def stop_profile(gw: GatewayDep, admin: AdminDep) -> dict[str, Any]:
    n = await _each_engine(gw, "stop_profile")
    return {"status": "stopped", "engines": n, "profile_dir": str(gw.settings.profile_dir)}
