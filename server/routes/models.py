"""GET /v1/models, /version"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from engine_adapter.routing import Router
from server.auth import AuthDep
from server.protocol import ModelCardOut, ModelList
from server.routes.docs import ERRORS
from server.state import GatewayDep, ServedModel

router = APIRouter(tags=["openai"])


def _card(name: str, m: ServedModel) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name, "object": "model", "created": m.created, "owned_by": "npu-gateway",
        "root": m.root, "parent": m.parent, "max_model_len": m.pool.card.max_model_len,
        "kind": m.pool.card.kind,  # generate | embed: a gateway in front tells them apart (docs/upstream-discovery.md)
    }
    slots = sum(w.slots for w in getattr(m.pool, "workers", ()))
    if slots:  # requests it runs at once (workers x --max-num-seqs); more wait in its queue
        card["slots"] = slots
    if isinstance(m.pool, Router):  # an alias: its targets, weights and fallbacks
        card["targets"] = [{"model": t.name, "weight": t.effective} for t in m.pool.targets]
        card["fallbacks"] = list(m.pool.fallbacks)
    return card


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(gw: GatewayDep, principal: AuthDep) -> Response:
    data = []
    for name, m in gw.models.items():
        if principal.entry is not None and principal.entry.models is not None and name not in principal.entry.models:
            continue
        data.append(_card(name, m))
    # a Response, so the aliases' extra fields are not filtered out by ModelList
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models/{model_id:path}", response_model=ModelCardOut, responses=ERRORS)
async def get_model(model_id: str, gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    m = gw.resolve(model_id, kind=gw.models[model_id].kind if model_id in gw.models else "generate")
    principal.check_model(m.id)
    return _card(m.id, m)
