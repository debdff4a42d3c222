"""Engines that start on their first request (WorkerPool(lazy=True), the
embedding engine's default on CPU): one start for concurrent first
requests, ready meanwhile, a failed start retried, shutdown during a start."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineDead, ShuttingDown
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EmbeddingRequest, GenerationRequest, ModelCard, SamplingOptions
from server.app import create_app
from server.settings import Settings


class SlowStart(SimulatedEngine):
    """Starts when `go` is set; fails its first `fail` starts."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__(SimulatedConfig(kind="embed"))
        self.go = asyncio.Event()
        self.fail = fail
        self.starts = 0
        self.stops = 0

    async def start(self) -> None:
        self.starts += 1
        await self.go.wait()
        if self.starts <= self.fail:
            raise RuntimeError("no memory for the KV cache")
        await super().start()

    async def stop(self) -> None:
        self.stops += 1
        await super().stop()


def lazy_pool(engine: SimulatedEngine, **kw: Any) -> WorkerPool:
    planned = ModelCard(max_model_len=256, kind="embed", embedding_dim=8, root="planned")
    return WorkerPool("emb", lambda i: engine, lazy=True, planned_card=planned, readiness_interval=60, **kw)


def emb(rid: str) -> EmbeddingRequest:
    return EmbeddingRequest(request_id=rid, model="emb", inputs=((1, 2, 3),))


@pytest.mark.asyncio
async def test_concurrent_first_requests_share_one_start() -> None:
    engine = SlowStart()
    pool = lazy_pool(engine)
    await pool.start()
    try:
        assert engine.starts == 0 and pool.deferred
        assert pool.ready() and pool.alive_workers() == 0  # ready: a request would start it
        assert pool.card.root == "planned"
        calls = [asyncio.ensure_future(pool.embed(emb(f"e{i}"))) for i in range(5)]
        await asyncio.sleep(0)  # let them all reach the start
        for _ in range(3):
            await asyncio.sleep(0)
        assert engine.starts == 1 and not any(c.done() for c in calls)
        engine.go.set()
        done = await asyncio.wait_for(asyncio.gather(*calls), 5)
        assert [len(d.vectors) for d in done] == [1] * 5
        assert engine.starts == 1 and not pool.deferred
        assert pool.alive_workers() == 1 and pool.ready_workers() == 1
        assert pool.card.root == "simulated"  # the engine's own card from now on
    finally:
        await pool.stop()


@pytest.mark.asyncio
async def test_a_failed_start_is_a_503_and_the_next_request_tries_again() -> None:
    engine = SlowStart(fail=1)
    engine.go.set()
    pool = lazy_pool(engine)
    await pool.start()
    try:
        with pytest.raises(EngineDead) as e:
            await pool.embed(emb("a"))
        assert e.value.retry_after == 5 and "failed to start" in e.value.message  # EngineDead: a 503
        assert pool.deferred and pool.ready()
        out = await asyncio.wait_for(pool.embed(emb("b")), 5)
        assert out.vectors and engine.starts == 2 and not pool.deferred
    finally:
        await pool.stop()


@pytest.mark.asyncio
async def test_generation_requests_start_a_lazy_generator_too() -> None:
    engine = SimulatedEngine()
    pool = WorkerPool("gen", lambda i: engine, lazy=True, readiness_interval=60)
    await pool.start()
    try:
        assert not engine.started
        req = GenerationRequest(request_id="g", model="gen", prompt_token_ids=(5, 6), sampling=SamplingOptions(3))
        outs = [o async for o in pool.generate(req) if o is not None]
        assert engine.started and outs[-1].finish_reason == "length"
    finally:
        await pool.stop()


@pytest.mark.asyncio
async def test_stop_during_a_start_waits_for_it_and_stops_the_engine() -> None:
    engine = SlowStart()
    pool = lazy_pool(engine)
    await pool.start()
    first = asyncio.ensure_future(pool.embed(emb("a")))
    for _ in range(3):
        await asyncio.sleep(0)
    assert engine.starts == 1
    stopping = asyncio.ensure_future(pool.stop())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not stopping.done()  # its processes must not outlive the pool
    engine.go.set()
    await asyncio.wait_for(stopping, 5)
    assert engine.stops == 1 and not engine.started
    with pytest.raises(ShuttingDown):
        await pool.embed(emb("late"))
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


@pytest.mark.asyncio
async def test_the_app_serves_a_deferred_embedding_model() -> None:
    settings = Settings(backend="simulated", embedding_start="lazy", readiness_interval=60)
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        emb_pool = next(p for p in app.state.gateway.pools if p.card.kind == "embed")
        assert emb_pool.deferred
        ready = await c.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["models"][emb_pool.name] == {"alive": 0, "ready": 0, "deferred": True}
        metrics = (await c.get("/metrics")).text
        assert f'npugw_workers_ready{{model_name="{emb_pool.name}"}}' not in metrics
        assert 'npugw_workers_ready{model_name="simulated"} 1.0' in metrics
        models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        assert models[emb_pool.name]["max_model_len"] == 512
        r = await c.post("/v1/embeddings", json={"model": emb_pool.name, "input": "hello"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 8
        assert not emb_pool.deferred
        assert (await c.get("/ready")).json()["models"][emb_pool.name] == {"alive": 1, "ready": 1}
        assert f'npugw_workers_ready{{model_name="{emb_pool.name}"}} 1.0' in (await c.get("/metrics")).text
