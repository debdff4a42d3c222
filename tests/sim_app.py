"""The real ASGI app in process, on simulated engines (fast)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from support import free_port, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from server.app import create_app
from server.settings import Settings

AppFactory = Callable[..., Any]


@asynccontextmanager
async def running_app(
    settings: Settings | None = None,
    sim: SimulatedConfig | None = None,
    embed: bool = True,
    slots: int = 64,
    **pool_kw: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = settings or Settings()
    engines: list[SimulatedEngine] = []

    def factory(cfg: SimulatedConfig) -> Callable[[int], SimulatedEngine]:
        def make(i: int) -> SimulatedEngine:
            e = SimulatedEngine(cfg, name="sim")
            engines.append(e)
            return e

        return make

    cfg = sim or SimulatedConfig(max_model_len=256)
    pools = [(WorkerPool("sim", factory(cfg), slots_per_worker=slots, **pool_kw), ("sim", "sim-alias"), "sim")]
    if embed:
        ecfg = SimulatedConfig(kind="embed", max_model_len=64, embedding_dim=8)
        pools.append((WorkerPool("emb", factory(ecfg)), ("emb",), "emb"))
    app = create_app(settings, pools=pools)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            client.engines = engines  # type: ignore[attr-defined]
            yield client, app


@asynccontextmanager
async def serve(
    pools: list[tuple[WorkerPool, tuple[str, ...], str]] | None, settings: Settings | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app on a real uvicorn server on 127.0.0.1 (statuses and bytes as
    a client sees them on the wire)."""
    app = create_app(settings or Settings(), pools=pools)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_until(lambda: server.started, timeout=60, what="uvicorn to start")
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30, limits=limits) as client:
            yield client, app
    finally:
        server.should_exit = True
        await task


