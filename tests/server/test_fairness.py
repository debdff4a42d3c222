"""Fair share and deadline-aware admission through the HTTP layer, on
simulated engines: the keys file's `weight` and `ttft_deadline_ms`, the
`x-ttft-deadline-ms` header (a bad one is a 400 in the API's own shape, an
unmeetable one a 429 before any byte), GET /admin/queue, the queue metrics,
and a SIGHUP reload that switches the policy with requests queued."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from sim_app import serve
from support import metric_value, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from server.app import create_app
from server.auth import KeysFileError
from server.routes.routing_admin import reload_routes
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}


def sim_pool(**kw: Any) -> WorkerPool:
    return WorkerPool("sim", lambda i: SimulatedEngine(SimulatedConfig(itl=0.01), name="sim"),
                      readiness_interval=60, slots_per_worker=1, **kw)


def keys_file(tmp_path: Path, **extra: dict[str, Any]) -> Path:
    entries = [{"name": "admin", "sha256": hashlib.sha256(b"sk-admin").hexdigest(), "admin": True}]
    for name in ("a", "b"):
        entries.append({"name": name, "sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest(),
                        **extra.get(name, {})})
    p = tmp_path / "keys.yaml"
    p.write_text(yaml.safe_dump({"keys": entries}))
    return p


def sample(metrics: str, name: str, **labels: str) -> float:
    """A sample's value, 0 when the series is absent."""
    try:
        return float(metric_value(metrics, name, **labels) or 0)
    except KeyError:
        return 0.0


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}"}


async def stream(client: httpx.AsyncClient, key: str, body: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, path: str = "/v1/chat/completions") -> tuple[
                     httpx.Response, bytes]:
    async with client.stream("POST", path, json=body or CHAT, headers={**auth(key), **(headers or {})}) as r:
        raw = await r.aread()
    return r, raw


@pytest.mark.parametrize("entry, field", [
    ({"weight": 0}, "weight"), ({"weight": "2"}, "weight"), ({"weight": -1.5}, "weight"),
    ({"ttft_deadline_ms": "soon"}, "ttft_deadline_ms"), ({"ttft_deadline_ms": 0}, "ttft_deadline_ms"),
])
def test_a_bad_weight_or_default_deadline_stops_the_start_naming_key_and_field(
    tmp_path: Path, entry: dict[str, Any], field: str
) -> None:
    path = keys_file(tmp_path, b=entry)
    with pytest.raises(KeysFileError) as err:
        create_app(Settings(api_keys_file=path), pools=[(sim_pool(), ("sim",), "sim")])
    assert "'b'" in str(err.value) and f"`{field}`" in str(err.value)


@pytest.mark.asyncio
async def test_a_malformed_or_negative_deadline_header_is_a_400_in_the_apis_own_shape(tmp_path: Path) -> None:
    s = Settings(api_keys_file=keys_file(tmp_path))
    async with serve([(sim_pool(), ("sim",), "sim")], s) as (client, _):
        for bad in ("soon", "-5", "0", "nan", "inf"):
            r, raw = await stream(client, "a", headers={"x-ttft-deadline-ms": bad})
            assert r.status_code == 400 and not raw.startswith(b"data:"), raw
            err = orjson.loads(raw)["error"]
            assert err["param"] == "x-ttft-deadline-ms" and err["type"] == "invalid_request_error"
        messages = {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        r, raw = await stream(client, "a", messages, {"x-ttft-deadline-ms": "-1"}, path="/v1/messages")
        body = orjson.loads(raw)
        assert r.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        r, raw = await stream(client, "a", headers={"x-ttft-deadline-ms": "5000"})
        assert r.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.asyncio
async def test_an_unmeetable_deadline_is_a_429_before_any_byte(tmp_path: Path) -> None:
    s = Settings(api_keys_file=keys_file(tmp_path, b={"ttft_deadline_ms": 100}))
    pool = sim_pool(max_queue_wait=30)
    async with serve([(pool, ("sim",), "sim")], s) as (client, _):
        for _ in range(6):  # the service rate gets measured (one slot: every release is a busy one)
            r, _raw = await stream(client, "a")
            assert r.status_code == 200
        assert pool.queue_stats.rate.per_second is not None
        long = asyncio.ensure_future(stream(client, "a", {**CHAT, "max_tokens": 150}))
        await wait_until(lambda: pool.running == 1, what="the slot to be taken")
        queued = asyncio.ensure_future(stream(client, "a", {**CHAT, "max_tokens": 150}))
        await wait_until(lambda: pool.queue_depth == 1, what="a request to queue")
        # about 150 tokens at ~10 ms each are ahead of a: a 50 ms deadline cannot be met
        r, raw = await stream(client, "a", headers={"x-ttft-deadline-ms": "50"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, raw
        assert not raw.startswith(b"data:") and orjson.loads(raw)["error"]["code"] == "deadline_unmeetable"
        # b's key default (100 ms) is admitted at arrival only if the estimate fits; either way it is
        # refused before any byte, at arrival or when it expires in the queue
        r, raw = await stream(client, "b")
        assert r.status_code == 429 and orjson.loads(raw)["error"]["code"] == "deadline_unmeetable"
        metrics = (await client.get("/metrics", headers=auth("admin"))).text
        refused = sum(sample(metrics, "npugw_queue_refusals_total", model_name="sim", api_key_name=k, reason=reason)
                      for k in ("a", "b") for reason in ("deadline_unmeetable", "deadline_expired"))
        assert refused == 2
        assert metric_value(metrics, "npugw_queue_saturation", model_name="sim") == 2.0  # 1 running + 1 queued
        assert metric_value(metrics, "npugw_queue_depth_by_key", model_name="sim", api_key_name="a") == 1
        assert (metric_value(metrics, "npugw_queue_wait_seconds_count", model_name="sim", api_key_name="a")
                or 0) >= 7
        for task in (long, queued):
            r, raw = await task
            assert r.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.asyncio
async def test_admin_queue_shows_depth_per_key_and_the_next_keys(tmp_path: Path) -> None:
    s = Settings(api_keys_file=keys_file(tmp_path, a={"weight": 3}))
    pool = sim_pool(max_queue_wait=30)
    async with serve([(pool, ("sim",), "sim")], s) as (client, _):
        assert pool.queue.weights == {"a": 3.0} and pool.queue_policy == "fair"
        first = asyncio.ensure_future(stream(client, "a", {**CHAT, "max_tokens": 60}))
        await wait_until(lambda: pool.running == 1)
        rest = [asyncio.ensure_future(stream(client, k)) for k in ("a", "a", "b")]
        await wait_until(lambda: pool.queue_depth == 3)
        assert (await client.get("/admin/queue", headers=auth("a"))).status_code == 403
        r = await client.get("/admin/queue", headers=auth("admin"))
        m = r.json()["models"]["sim"]
        assert m["policy"] == "fair" and m["depth"] == 3 and m["running"] == 1
        assert m["keys"]["a"] == {"queued": 2, "running": 1, "weight": 3.0}
        assert m["keys"]["b"] == {"queued": 1, "running": 0, "weight": 1.0}
        assert [n["api_key_name"] for n in m["next"]] == ["b", "a", "a"]  # b is new: it goes next
        for t in (first, *rest):
            r, _raw = await t
            assert r.status_code == 200


@pytest.mark.asyncio
async def test_a_new_key_on_a_reserve_slot_shows_in_admin_queue_and_the_metrics(tmp_path: Path) -> None:
    s = Settings(api_keys_file=keys_file(tmp_path))
    pool = sim_pool(max_queue_wait=30, reserve_slots=1)
    async with serve([(pool, ("sim",), "sim")], s) as (client, _):
        flood = [asyncio.ensure_future(stream(client, "a", {**CHAT, "max_tokens": 300})) for _ in range(3)]
        await wait_until(lambda: pool.running == 1 and pool.queue_depth == 2, what="the flood to queue")
        b = asyncio.ensure_future(stream(client, "b", {**CHAT, "max_tokens": 300}))
        await wait_until(lambda: pool.running == 2, what="b to start beside the flood")
        m = (await client.get("/admin/queue", headers=auth("admin"))).json()["models"]["sim"]
        assert (m["capacity"], m["reserve"], m["reserve_running"], m["running"], m["depth"]) == (1, 1, 1, 2, 2)
        assert m["reserve_admissions"] == {"new_flow": 1, "priority": 0}
        assert m["keys"]["b"] == {"queued": 0, "running": 1, "weight": 1.0}
        metrics = (await client.get("/metrics", headers=auth("admin"))).text
        assert metric_value(metrics, "npugw_queue_reserve_admissions_total", model_name="sim", reason="new_flow") == 1
        assert metric_value(metrics, "npugw_queue_reserve_running", model_name="sim") == 1
        for t in (b, *flood):
            t.cancel()
        await asyncio.gather(b, *flood, return_exceptions=True)
        await wait_until(lambda: pool.running == 0 and pool.reserve_running == 0, what="every slot back")


@pytest.mark.asyncio
async def test_a_sighup_reload_switches_the_policy_and_loses_nothing_queued(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text("queue_policy: fair\n")
    pool = sim_pool(max_queue_wait=30)
    async with serve([(pool, ("sim",), "sim")], Settings(config=config)) as (client, app):
        assert pool.queue_policy == "fair"
        gw = app.state.gateway
        first = asyncio.ensure_future(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40}))
        await wait_until(lambda: pool.running == 1)
        queued = [asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT)) for _ in range(5)]
        await wait_until(lambda: pool.queue_depth == 5)
        config.write_text("queue_policy: fifo\n")
        assert reload_routes(gw)
        assert pool.queue_policy == "fifo" and pool.queue_depth == 5
        for r in await asyncio.gather(first, *queued):
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
