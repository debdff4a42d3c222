"""GET /v1/models, /version"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.deps import AuthDep, GatewayDep
from server.protocol import ModelList

router = APIRouter(tags=["openai"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    data = []
    for name, m in gw.models.items():
        if principal.entry is not None and principal.entry.models is not None and name not in principal.entry.models:
            continue
        data.append(
            {
                "id": name,
                "object": "model",
                "created": m.created,
                "owned_by": "npu-gateway",
                "root": m.root,
                "parent": m.parent,
                "max_model_len": m.pool.card.max_model_len,
            }
        )
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}", response_model=None)
async def get_model(model_id: str, gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    m = gw.resolve(model_id, kind=gw.models[model_id].kind if model_id in gw.models else "generate")
    principal.check_model(m.id)
    return {
        "id": m.id, "object": "model", "created": m.created, "owned_by": "npu-gateway",
        "root": m.root, "parent": m.parent, "max_model_len": m.pool.card.max_model_len,
    }
