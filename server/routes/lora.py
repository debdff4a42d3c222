"""LoRA adapters at run time: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` in vLLM's request shapes, guarded by the
admin key. The adapters themselves: engine_adapter/lora_manager.py.

`setup_lora(app, registry)` wires the routes and the per-adapter metrics
into `create_app`; `start_lora(app, gw)` (in the lifespan, once the pools
run, before the routing table is built so aliases may name adapters)
loads `--lora-modules` and the adapters persisted in the data directory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from engine_adapter.errors import InvalidRequest
from engine_adapter.lora import AdapterPool, LoraMetrics, LoraModule
from engine_adapter.lora_manager import STORE_NAME, LoraManager
from engine_adapter.pool import WorkerPool
from engine_adapter.tasks import cancel_and_wait
from server.auth import Principal, require_admin
from server.routes.docs import ERRORS
from server.state import Gateway, GatewayDep

logger = logging.getLogger(__name__)

router = APIRouter(tags=["admin"])
# vLLM's answer is plain text on success; every refusal is the JSON error shape
_PLAIN: dict[int | str, dict[str, Any]] = {
    **ERRORS, 200: {"description": "vLLM's plain-text success line", "content": {"text/plain": {}}},
}
AdminDep = Annotated[Principal, Depends(require_admin)]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's LoadLoRAAdapterRequest, plus which local model it adapts."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    base_model_name: str | None = Field(None, description="npu-gateway: the base model (default: --model's)")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def _manager(gw: Gateway) -> LoraManager:
    mgr = gw.lora
    if mgr is None or not mgr.enabled:
        raise InvalidRequest("LoRA is off on this server: start it with --enable-lora", code="lora_disabled")
    return mgr


def _serve(gw: Gateway, adapter: AdapterPool) -> None:
    gw.add_served(adapter.name, adapter, root=adapter.root, parent=adapter.base_name)


@router.post("/v1/load_lora_adapter", responses=_PLAIN, response_class=Response)
async def load_lora_adapter(body: LoadLoraAdapterRequest, gw: GatewayDep, admin: AdminDep) -> PlainTextResponse:
    mgr = _manager(gw)
    adapter = await mgr.load(
        LoraModule(body.lora_name, body.lora_path, body.base_model_name), load_inplace=body.load_inplace
    )
    _serve(gw, adapter)
    logger.info("LoRA adapter %s loaded by %s", adapter.name, admin.name or "open server")
    return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=_PLAIN, response_class=Response)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, gw: GatewayDep, admin: AdminDep) -> PlainTextResponse:
    mgr = _manager(gw)
    name = body.lora_name
    users = gw.routes_using(name)
    if users and name in mgr.adapters:
        raise InvalidRequest(
            f"LoRA adapter '{name}' is a target or fallback of {', '.join(users)}; change the routes first",
            param="lora_name",
        )
    await mgr.unload(name)
    gw.remove_served(name)
    logger.info("LoRA adapter %s unloaded by %s", name, admin.name or "open server")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def setup_lora(app: FastAPI, registry: CollectorRegistry) -> None:
    """In create_app: the per-adapter metrics and the routes."""
    app.state.lora_metrics = LoraMetrics(registry)
    app.include_router(router)


def lora_bases(gw: Gateway) -> dict[str, WorkerPool]:
    """The local generation models whose engines run with LoRA on, by id."""
    out: dict[str, WorkerPool] = {}
    for name, m in gw.base_models.items():
        pool = m.pool
        if m.parent is not None or not isinstance(pool, WorkerPool) or pool.relays:
            continue
        config: Any = getattr(pool.workers[0].engine, "config", None)
        if getattr(config, "enable_lora", False) or getattr(config, "lora", False):
            out[name] = pool
    return out


def sync_upstream_adapters(gw: Gateway) -> None:
    """Serve the adapters the upstream nodes list now; drop the gone ones."""
    if gw.lora is None:
        return
    added, removed = gw.lora.sync_upstreams(gw.pools)
    for adapter in removed:
        if not gw.routes_using(adapter.name):
            gw.remove_served(adapter.name)
    for adapter in added:
        _serve(gw, adapter)


async def _sync_loop(gw: Gateway, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            sync_upstream_adapters(gw)
        except Exception:  # never let the loop die
            logger.exception("LoRA adapters of upstream nodes: sync failed")


async def start_lora(app: FastAPI, gw: Gateway) -> None:
    """In the lifespan, once the pools run: `--lora-modules`, then the
    adapters loaded at run time before this start, then those of the
    upstream nodes (and every health interval after)."""
    s = gw.settings
    bases = lora_bases(gw) if s.enable_lora else {}
    store = s.data_dir.expanduser() / STORE_NAME
    gw.lora = LoraManager(bases, max_rank=s.max_lora_rank, store=store, metrics=app.state.lora_metrics,
                          taken=gw.serves)
    if bases:
        for adapter in await gw.lora.restore(s.parsed.lora_modules):
            _serve(gw, adapter)
    elif s.enable_lora:
        logger.warning("--enable-lora: no local generation model here takes LoRA adapters")
    if any(p.relays for p in gw.pools):
        sync_upstream_adapters(gw)
        app.state.lora_sync = asyncio.ensure_future(_sync_loop(gw, s.upstream_health_interval))
    if gw.lora.adapters:
        logger.info("LoRA adapters: %s", ", ".join(f"{a.name} ({a.base_name})" for a in gw.lora.adapters.values()))


async def stop_lora(app: FastAPI) -> None:
    task = getattr(app.state, "lora_sync", None)
    if task is not None:
        app.state.lora_sync = None
        await cancel_and_wait([task])
