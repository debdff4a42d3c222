"""GET /admin/queue (admin key): each model's queue policy, depth per key,
what runs per key, and the next keys to serve (server/queueing.py)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Query
from starlette.responses import Response

from server.queueing import describe
from server.routes.admin import AdminDep
from server.routes.docs import ERRORS
from server.state import GatewayDep

router = APIRouter(tags=["ops"])


@router.get("/admin/queue", responses=ERRORS)
async def queue(gw: GatewayDep, admin: AdminDep, upcoming: int = Query(8, ge=0, le=100)) -> Response:
    body = {"models": {p.name: describe(p, upcoming) for p in gw.pools}}
    return Response(orjson.dumps(body), media_type="application/json")
