"""Routing on simulated engines (and real local upstream servers): weights,
sticky sessions, canary rollback, fallbacks, a black-holed upstream, and the
HTTP side (admin routes, served-by header, /v1/models, reload)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from support import free_port, wait_until

from engine_adapter.backends.remote import build_remote_pool
from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineError, QueueFull
from engine_adapter.lease import Prepared, RelayLease
from engine_adapter.pool import WorkerPool
from engine_adapter.routing import (
    CanaryPolicy,
    RoutingMetrics,
    RoutingTable,
    parse_alias,
    route_specs,
)
from engine_adapter.routing.upstream import UpstreamConfig
from engine_adapter.types import EngineOutput, GenerationRequest, RelayCall, SamplingOptions
from server.app import create_app
from server.routes.routing_admin import reload_routes
from server.settings import Settings


class FlakyEngine(SimulatedEngine):
    """Fails with EngineError before the first token, or after `after` tokens."""

    def __init__(self, cfg: SimulatedConfig | None = None, after: int | None = None) -> None:
        super().__init__(cfg)
        self.after = after
        self.calls = 0

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        self.calls += 1
        n = 0
        if self.after is not None:
            async for out in super().generate(req):
                if n == self.after:
                    break
                n += 1
                yield out
        raise EngineError("boom")


def req(rid: str = "r", max_tokens: int = 2) -> GenerationRequest:
    sampling = SamplingOptions(max_tokens)
    return GenerationRequest(request_id=rid, model="alias", prompt_token_ids=(72, 105), sampling=sampling)


def pool(name: str, make: Callable[[], SimulatedEngine] | None = None, **kw: Any) -> WorkerPool:
    kw = {"readiness_interval": 60, "probe_timeout": 0.1, **kw}  # a hung engine's start-up probe gives up soon
    return WorkerPool(name, lambda i: make() if make else SimulatedEngine(name=name), **kw)


@asynccontextmanager
async def table(
    pools: dict[str, WorkerPool], routes: list[str], fallbacks: Sequence[str] = (), policy: CanaryPolicy | None = None
) -> AsyncIterator[RoutingTable]:
    for p in set(pools.values()):
        await p.start()
    t = RoutingTable(pools, policy=policy, metrics=RoutingMetrics(CollectorRegistry()), rng=random.Random(7))
    t.apply(route_specs(routes, fallbacks))
    try:
        yield t
    finally:
        for p in set(pools.values()):
            await p.stop()


@dataclass
class Served:
    served_by: str  # the target whose lease was granted
    answered_by: str  # the target that produced the tokens (after any in-stream fallback)


async def run(t: RoutingTable, alias: str, rid: str, session: str | None = None, tokens: int = 2) -> Served:
    lease = await t.routers[alias].acquire(Prepared([req(rid, tokens)]), session)
    granted = lease.served_by
    try:
        outs = [o async for _, batch in lease.stream() if batch for o in batch]
    finally:
        lease.release()
    assert outs[-1].finish_reason == "length"
    return Served(granted, lease.served_by)


def value(t: RoutingTable, name: str, **labels: str) -> float:
    for metric in (t.metrics.requests, t.metrics.fallbacks, t.metrics.weight, t.metrics.rollbacks):
        for fam in metric.collect():
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
    return 0.0


def test_parse_alias_weights_and_names_with_colons() -> None:
    assert parse_alias("chat=qwen-v2:90, qwen-v3:10") == ("chat", (("qwen-v2", 90.0), ("qwen-v3", 10.0)))
    assert parse_alias("c=llama3:8b") == ("c", (("llama3:8b", 1.0),))  # not a weight: part of the name
    assert parse_alias("c=llama3:8b:5,x")[1] == (("llama3:8b", 5.0), ("x", 1.0))
    for bad in ("c", "c=", "c=a:0", "c=a:-1,b:1", "c=a,a"):
        with pytest.raises(ValueError):
            parse_alias(bad)
    specs = route_specs(["c=a:1,b:1"], ["c=z", "solo=y"])
    assert specs["c"].fallbacks == ("z",) and specs["solo"].targets == (("solo", 1.0),)


@pytest.mark.asyncio
async def test_weights_split_traffic() -> None:
    pools = {"v2": pool("v2"), "v3": pool("v3")}
    async with table(pools, ["chat=v2:90,v3:10"]) as t:
        served = Counter([(await run(t, "chat", f"r{i}")).answered_by for i in range(400)])
        assert served["v2"] + served["v3"] == 400
        assert 20 <= served["v3"] <= 65, served  # 10% of 400 = 40
        assert value(t, "npugw_route_requests_total", alias="chat", target="v3", outcome="ok") == served["v3"]


@pytest.mark.asyncio
async def test_sticky_sessions_and_minimal_moves_on_weight_change() -> None:
    pools = {"v2": pool("v2"), "v3": pool("v3")}
    async with table(pools, ["chat=v2:50,v3:50"]) as t:
        first = {}
        for s in range(200):
            picks = {(await run(t, "chat", f"{s}-{k}", session=f"user-{s}")).answered_by for k in range(3)}
            assert len(picks) == 1  # a conversation stays on one version
            first[s] = picks.pop()
        share = Counter(first.values())["v3"] / 200
        assert 0.35 <= share <= 0.65, share
        t.apply(route_specs(["chat=v2:80,v3:20"], []))
        after = {s: t.routers["chat"].choose(f"user-{s}").name for s in range(200)}
        moved = [s for s in range(200) if after[s] != first[s]]
        assert moved and all(first[s] == "v3" and after[s] == "v2" for s in moved)  # only v3 -> v2 moves


@pytest.mark.asyncio
async def test_failing_canary_is_rolled_back(caplog: pytest.LogCaptureFixture) -> None:
    canary = pool("v3", lambda: FlakyEngine())
    pools = {"v2": pool("v2"), "v3": canary}
    policy = CanaryPolicy(min_requests=5, max_error_rate=0.5, check_every=0)
    with caplog.at_level(logging.WARNING, logger="engine_adapter.routing.router"):
        async with table(pools, ["chat=v2:80,v3:20"], ["chat=v2"], policy) as t:
            served = Counter([(await run(t, "chat", f"r{i}")).answered_by for i in range(200)])
            engine = canary.workers[0].engine
            assert isinstance(engine, FlakyEngine) and engine.calls == 1 + 5  # the start-up probe, 5, no more
            assert served == {"v2": 200}  # the failures fell back before any token
            router = t.routers["chat"]
            assert router.targets[1].rolled_back and router.targets[1].effective == 0
            assert value(t, "npugw_route_weight", alias="chat", target="v3") == 0
            assert value(t, "npugw_canary_rollbacks_total", alias="chat", target="v3", reason="error_rate") == 1
            assert value(t, "npugw_route_fallbacks_total", alias="chat", reason="error") == 5
            t.apply(route_specs(["chat=v2:80,v3:20"], ["chat=v2"]))  # setting routes again restores it
            assert t.routers["chat"].targets[1].effective == 20
    assert any("canary v3 rolled back" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_slow_canary_is_rolled_back_on_ttft() -> None:
    slow = pool("v3", lambda: SimulatedEngine(SimulatedConfig(ttft=0.03)))
    pools = {"v2": pool("v2"), "v3": slow}
    policy = CanaryPolicy(min_requests=3, max_error_rate=None, max_ttft_p95=0.01, check_every=0)
    async with table(pools, ["chat=v2:50,v3:40"], policy=policy) as t:
        for i in range(40):
            await run(t, "chat", f"r{i}")
        assert t.routers["chat"].targets[1].rolled_back is not None
        assert value(t, "npugw_canary_rollbacks_total", alias="chat", target="v3", reason="ttft_p95") == 1


@pytest.mark.asyncio
async def test_the_primary_is_never_rolled_back() -> None:
    pools = {"v2": pool("v2", lambda: FlakyEngine()), "v3": pool("v3")}
    policy = CanaryPolicy(min_requests=2, check_every=0)
    async with table(pools, ["chat=v2:90,v3:10"], ["chat=v3"], policy) as t:
        for i in range(30):
            await run(t, "chat", f"r{i}")
        assert all(x.rolled_back is None for x in t.routers["chat"].targets)


@pytest.mark.asyncio
async def test_fallback_on_full_queue_and_on_queue_timeout() -> None:
    hang = SimulatedConfig(hang=True)
    full = pool("full", lambda: SimulatedEngine(hang), slots_per_worker=1, max_queue_size=0)
    slow = pool("slow", lambda: SimulatedEngine(hang), slots_per_worker=1, max_queue_size=4, max_queue_wait=0.05)
    pools = {"full": full, "slow": slow, "small": pool("small")}
    async with table(pools, [], ["full=small", "slow=small"]) as t:
        blockers = [asyncio.ensure_future(run(t, name, f"block-{name}")) for name in ("full", "slow")]
        await wait_until(lambda: full.running == 1 and slow.running == 1)
        got = await run(t, "full", "a")
        assert got.served_by == got.answered_by == "small"  # moved at admission
        t0 = time.monotonic()
        got = await run(t, "slow", "b")
        assert got.served_by == got.answered_by == "small"
        assert time.monotonic() - t0 >= 0.05  # after the queue wait, not before
        assert value(t, "npugw_route_fallbacks_total", alias="full", to_target="small", reason="queue_full") == 1
        assert value(t, "npugw_route_fallbacks_total", alias="slow", reason="queue_timeout") == 1
        for b in blockers:
            b.cancel()
        await asyncio.gather(*blockers, return_exceptions=True)


@pytest.mark.asyncio
async def test_without_fallback_the_error_reaches_the_client() -> None:
    full = pool("full", lambda: SimulatedEngine(SimulatedConfig(hang=True)), slots_per_worker=1, max_queue_size=0)
    async with table({"full": full, "other": pool("other")}, ["chat=full:1"]) as t:
        blocker = asyncio.ensure_future(run(t, "chat", "block"))
        await wait_until(lambda: full.running == 1)
        with pytest.raises(QueueFull):
            await run(t, "chat", "x")
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)


@pytest.mark.asyncio
async def test_never_retried_after_the_first_token() -> None:
    broken = pool("v2", lambda: FlakyEngine(after=1))
    backup = pool("v3")
    async with table({"v2": broken, "v3": backup}, [], ["v2=v3"]) as t:
        with pytest.raises(EngineError):
            await run(t, "v2", "r", tokens=5)
        assert value(t, "npugw_route_fallbacks_total", alias="v2") == 0
        assert backup.counters.dispatched == 0


async def serve_500() -> tuple[web.AppRunner, str]:
    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "upstream exploded"}}, status=500)

    app = web.Application()
    app.router.add_post("/v1/completions", fail)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def remote(url: str, **kw: Any) -> WorkerPool:
    cfg = UpstreamConfig(name="remote", urls=(url,), health_interval=60, **kw)
    return build_remote_pool(cfg, readiness_interval=3600, probe_timeout=0.5)


class Both:
    """An Ask: engine requests for a local target, a pass-through call for
    upstream nodes."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        return [replace(req(self.rid), model=model)]

    def relay(self, model: str) -> RelayCall:
        return RelayCall(self.rid, model, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, stream=True)


async def run_any(t: RoutingTable, alias: str, rid: str) -> str:
    """Through an alias whose targets may be local or remote: who answered."""
    lease = await t.routers[alias].acquire(Both(rid))
    try:
        if isinstance(lease, RelayLease):
            assert [i async for i in lease.relay()]
        else:
            outs = [o async for _, batch in lease.stream() if batch for o in batch]
            assert outs[-1].finish_reason == "length"
    finally:
        lease.release()
    return lease.served_by


@pytest.mark.asyncio
async def test_fallback_on_upstream_500() -> None:
    runner, url = await serve_500()
    try:
        async with table({"remote": remote(url), "local": pool("local")}, ["chat=remote:1"], ["chat=local"]) as t:
            assert await run_any(t, "chat", "r") == "local"
            labels = {"alias": "chat", "from_target": "remote", "reason": "unavailable"}
            assert value(t, "npugw_route_fallbacks_total", **labels) == 1
    finally:
        await runner.cleanup()


async def serve_hanging() -> tuple[web.AppRunner, str, asyncio.Event]:
    """A node that passes its health checks, then never answers a request
    (a hung engine behind a live HTTP server): the black hole requests meet."""
    never = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 2048}]})

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response(status=500)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", never


@pytest.mark.asyncio
async def test_black_hole_upstream_never_hangs_requests_to_the_others() -> None:
    runner, url, never = await serve_hanging()
    pools = {"remote": remote(url, read_timeout=0.3, eject_after=3, cooldown=30), "local": pool("local")}
    try:
        async with table(pools, ["chat=remote:1"], ["chat=local"]) as t:
            assert pools["remote"].ready(), "the node must pass its checks: requests are to meet the hole"
            t0 = time.monotonic()
            done: list[str] = []

            async def timed(alias: str, rid: str) -> tuple[float, str]:
                if alias == "chat":
                    answered = await run_any(t, alias, rid)
                else:
                    [o async for o in pools["local"].generate(req(rid))]
                    answered = "direct"
                done.append(rid)
                return time.monotonic() - t0, answered

            results = await asyncio.gather(*(timed("chat", f"c{i}") for i in range(8)),
                                           *(timed("local", f"l{i}") for i in range(8)))
            routed, direct = [r[0] for r in results[:8]], [r[0] for r in results[8:]]
            # Order, not wall time (a loaded CI box may pause the process):
            # every direct request ends before the first routed one, which
            # waited out the read timeout at the hole and then fell back.
            assert all(rid.startswith("l") for rid in done[:8]), done
            assert {r[1] for r in results[:8]} == {"local"}
            assert min(routed) >= 0.3, routed  # they did meet the hole
            assert max(routed) < 1.5, routed  # read timeout, then the fallback
            t1 = time.monotonic()
            assert await run_any(t, "chat", "late") == "local"  # ejected after 3 timeouts: at once
            assert time.monotonic() - t1 < 0.3  # less than the read timeout: it did not wait
            print(f"black hole: {len(routed)} routed requests done in {max(routed):.2f}s; "
                  f"direct ones in {max(direct) * 1000:.0f} ms; after ejection {(time.monotonic() - t1) * 1000:.1f} ms")
    finally:
        never.set()
        await runner.cleanup()


# ---- the HTTP side -------------------------------------------------------

@asynccontextmanager
async def app_client(settings: Settings, itl: float = 0.0) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    cfg = SimulatedConfig(itl=itl)
    pools = [(pool(n, lambda n=n: SimulatedEngine(cfg, name=n)), (n,), n) for n in ("v2", "v3", "small")]
    app = create_app(settings, pools=pools)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            yield c, app


ADMIN = {"Authorization": "Bearer adm"}
USER = {"Authorization": "Bearer k1"}


def chat(model: str = "chat", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


@pytest.mark.asyncio
async def test_http_alias_header_models_stickiness_and_admin() -> None:
    s = Settings(api_key=["k1"], admin_api_key="adm", alias=["chat=v2:50,v3:50"], fallback=["chat=small"])
    async with app_client(s) as (c, _):
        models = {m["id"]: m for m in (await c.get("/v1/models", headers=USER)).json()["data"]}
        assert models["chat"]["targets"] == [{"model": "v2", "weight": 50}, {"model": "v3", "weight": 50}]
        assert models["chat"]["fallbacks"] == ["small"] and models["chat"]["parent"] == "v2"
        seen = set()
        for i in range(20):
            headers = {**USER, "X-Session-ID": f"s{i}"}
            a = await c.post("/v1/chat/completions", json=chat(), headers=headers)
            b = await c.post("/v1/chat/completions", json=chat(), headers=headers)
            assert a.status_code == 200 and a.headers["x-npugw-served-by"] == b.headers["x-npugw-served-by"]
            seen.add(a.headers["x-npugw-served-by"])
        assert seen == {"v2", "v3"}
        users = {(await c.post("/v1/chat/completions", json=chat(user="alice"), headers=USER)).headers[
            "x-npugw-served-by"] for _ in range(5)}
        assert len(users) == 1  # the `user` field is a session key too
        async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=USER) as r:
            body = await r.aread()
            assert r.headers["x-npugw-served-by"] in ("v2", "v3") and body.endswith(b"data: [DONE]\n\n")
        plain = await c.post("/v1/chat/completions", json=chat("v2"), headers=USER)
        assert plain.status_code == 200 and "x-npugw-served-by" not in plain.headers
        # admin: only the admin key may change routes
        update = {"aliases": {"chat": {"v2": 0, "v3": 100}}}
        assert (await c.post("/admin/routes", json=update, headers=USER)).status_code == 403
        r = await c.post("/admin/routes", json=update, headers=ADMIN)
        assert r.status_code == 200 and r.json()["aliases"]["chat"]["fallbacks"] == ["small"]
        for i in range(5):
            got = await c.post("/v1/chat/completions", json=chat(), headers={**USER, "X-Session-ID": f"s{i}"})
            assert got.headers["x-npugw-served-by"] == "v3"
        bad = await c.post("/admin/routes", json={"aliases": {"chat": "nope:1"}}, headers=ADMIN)
        assert bad.status_code == 400 and "not a served model" in bad.json()["error"]["message"]
        new = await c.post("/admin/routes", json={"aliases": {"canary": "v2:9,v3:1"}, "remove": ["chat"]},
                           headers=ADMIN)
        assert set(new.json()["aliases"]) == {"canary"}
        assert (await c.post("/v1/chat/completions", json=chat(), headers=USER)).status_code == 404
        assert (await c.post("/v1/chat/completions", json=chat("canary"), headers=USER)).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'npugw_route_requests_total{alias="chat",outcome="ok",target="v3"}' in metrics
        assert 'npugw_route_weight{alias="canary",target="v3"} 1.0' in metrics


@pytest.mark.asyncio
async def test_route_change_keeps_in_flight_streams() -> None:
    s = Settings(alias=["chat=v2:1"])
    async with app_client(s, itl=0.02) as (c, app):
        async def stream() -> bytes:
            body = chat(stream=True, max_tokens=15)
            async with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": "x"}) as r:
                assert r.headers["x-npugw-served-by"] == "v2"
                return await r.aread()

        task = asyncio.ensure_future(stream())
        v2 = app.state.gateway.base_models["v2"].pool
        await wait_until(lambda: v2.running == 1, what="the stream to start on v2")
        r = await c.post("/admin/routes", json={"aliases": {"chat": {"v3": 1}}})
        assert r.status_code == 200
        out = await task
        assert out.count(b'"content":') >= 15 and b'"error"' not in out and out.endswith(b"data: [DONE]\n\n")
        after = await c.post("/v1/chat/completions", json=chat())
        assert after.headers["x-npugw-served-by"] == "v3"


@pytest.mark.asyncio
async def test_reload_from_the_settings_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("alias:\n  chat: v2:90,v3:10\nfallback:\n  chat: [small]\n")
    async with app_client(Settings(config=path)) as (c, app):
        gw = app.state.gateway
        assert gw.routing.describe()["chat"]["fallbacks"] == ["small"]
        path.write_text("alias:\n  - chat=v3:1\n  - other=v2:1\n")
        assert reload_routes(gw)
        assert [x["model"] for x in gw.routing.describe()["chat"]["targets"]] == ["v3"]
        assert "other" in gw.models and gw.routing.describe()["chat"]["fallbacks"] == []
        path.write_text("alias:\n  - chat=missing:1\n")
        assert not reload_routes(gw)  # a bad file keeps the routes
        assert set(gw.routing.routers) == {"chat", "other"}
        r = await c.post("/v1/chat/completions", json=chat("other"))
        assert r.headers["x-npugw-served-by"] == "v2"
