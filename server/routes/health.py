"""/health (the process serves HTTP) and /ready (every model has a worker
that completed a real generation within --readiness-interval)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from engine_adapter.backends.remote import is_remote
from server.state import GatewayDep

router = APIRouter(tags=["ops"])


@router.get("/health", responses={200: {"content": {"application/json": {}}}})
async def health(gw: GatewayDep) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


_JSON: dict[str, Any] = {"content": {"application/json": {}}}


@router.get("/ready", responses={200: _JSON, 503: _JSON})
async def ready(gw: GatewayDep) -> Response:
    models: dict[str, dict[str, Any]] = {}
    for p in gw.pools:
        models[p.name] = {"alive": p.alive_workers(), "ready": p.ready_workers()}
        if p.deferred:
            models[p.name]["deferred"] = True  # its engine starts on the first request for it
    # With local engines, a remote upstream's health is the router's business
    # (breaker, fallback): it must not take this gateway out of the load
    # balancer. A gateway tier (no local engine) is ready when every served
    # name has at least one healthy node.
    local = [p for p in gw.pools if not is_remote(p)]
    ok = not gw.draining and all(p.ready() for p in (local or gw.pools))
    body = {"status": "ready" if ok else ("draining" if gw.draining else "not_ready"), "models": models}
    headers = {} if ok else {"Retry-After": "5"}
    return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type="application/json", headers=headers)
