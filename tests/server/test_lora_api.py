"""LoRA adapters on simulated engines (fast): the load/unload routes, every
worker of the base model loaded or none, persistence across a restart, key
access lists, aliases, metrics, and the prefix policy keeping adapters
apart. A simulated engine with an adapter runs its words backwards, so an
answer shows whether the adapter reached the engine. The real engine and a
real PEFT adapter: tests/integration/test_lora.py."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes import FakeNode
from sim_app import running_app, serve
from support import metric_value, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.backends.vllm_config import VllmConfig
from engine_adapter.errors import InvalidRequest
from engine_adapter.lora import parse_lora_module
from engine_adapter.routing.policy import PrefixPolicy
from engine_adapter.types import LoraRef
from server.settings import Settings

ADMIN = {"Authorization": "Bearer sk-admin"}


def fake_adapter(folder: Path, rank: int = 8, weights: bool = True) -> Path:
    """A PEFT-shaped folder (the simulated engine reads no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
           "base_model_name_or_path": "sim"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return folder


def keys_file(tmp: Path) -> Path:
    def entry(name: str, models: list[str] | None = None, admin: bool = False) -> dict[str, Any]:
        e: dict[str, Any] = {"name": name, "sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest()}
        if models is not None:
            e["models"] = models
        if admin:
            e["admin"] = True
        return e

    keys = [entry("admin", admin=True), entry("base-only", ["sim"]), entry("tuned", ["sim", "tuned"])]
    path = tmp / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": keys}))
    return path


@asynccontextmanager
async def lora_app(tmp: Path, workers: int = 2, **kw: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = Settings(enable_lora=True, data_dir=tmp / "data", api_keys_file=keys_file(tmp), **kw)
    async with running_app(settings, sim=SimulatedConfig(max_model_len=256, lora=True), embed=False,
                           num_workers=workers) as (client, app):
        yield client, app


def chat(model: str, key: str = "admin") -> dict[str, Any]:
    return {"json": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            "headers": {"Authorization": f"Bearer sk-{key}"}}


def engines(app: Any) -> list[SimulatedEngine]:
    return [w.engine for w in app.state.gateway.models["sim"].pool.workers]


@pytest.mark.asyncio
async def test_load_use_unload_then_404(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "tuned")
    async with lora_app(tmp_path) as (c, app):
        base = (await c.post("/v1/chat/completions", **chat("sim"))).json()["choices"][0]["message"]["content"]
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(path)}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert "tuned" in r.text
        assert [sorted(ref.name for ref in e.loras.values()) for e in engines(app)] == [["tuned"], ["tuned"]]
        cards = {m["id"]: m for m in (await c.get("/v1/models", headers=ADMIN)).json()["data"]}
        assert cards["tuned"]["parent"] == "sim" and cards["tuned"]["root"] == str(path)
        r = await c.post("/v1/chat/completions", **chat("tuned"))
        assert r.status_code == 200, r.text
        tuned = r.json()["choices"][0]["message"]["content"]
        assert r.json()["model"] == "tuned"
        assert tuned != base  # the adapter reached the engine
        r = await c.post("/v1/completions", json={"model": "tuned", "prompt": "x", "max_tokens": 4}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tuned
        r = await c.post("/generate", json={"model": "tuned", "prompt": "x", "max_tokens": 4}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["text"] == ["x" + tuned]

        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert all(not e.loras for e in engines(app))
        r = await c.post("/v1/chat/completions", **chat("tuned"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "tuned" not in {m["id"] for m in (await c.get("/v1/models", headers=ADMIN)).json()["data"]}
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=ADMIN)
        assert r.status_code == 404


@pytest.mark.asyncio
async def test_bad_loads_are_400s_that_name_the_problem(tmp_path: Path) -> None:
    good = fake_adapter(tmp_path / "good")
    async with lora_app(tmp_path) as (c, app):
        async def load(name: str, path: str, key: str = "admin") -> httpx.Response:
            return await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                headers={"Authorization": f"Bearer sk-{key}"})

        r = await load("x", str(tmp_path / "missing"))
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        r = await load("x", str(fake_adapter(tmp_path / "big", rank=64)))
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "rank 64" in msg and "16" in msg and "--max-lora-rank" in msg
        assert r.json()["error"]["code"] == "lora_rank_too_large"
        (tmp_path / "empty").mkdir()
        r = await load("x", str(tmp_path / "empty"))
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        r = await load("x", str(fake_adapter(tmp_path / "noweights", weights=False)))
        assert r.status_code == 400 and "weights" in r.json()["error"]["message"]
        r = await load("sim", str(good))
        assert r.status_code == 400 and "conflicts" in r.json()["error"]["message"]
        r = await load("tuned", str(good), key="tuned")  # not the admin key
        assert r.status_code == 403
        assert all(not e.loras for e in engines(app))  # nothing reached an engine
        assert (await load("tuned", str(good))).status_code == 200
        r = await load("tuned", str(good))
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "tuned"}, headers=ADMIN)
        assert r.status_code == 400  # vLLM's shape: lora_path is required


@pytest.mark.asyncio
async def test_lora_off_is_a_400(tmp_path: Path) -> None:
    async with running_app(Settings(admin_api_key="sk-admin"), embed=False) as (c, _):
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(fake_adapter(tmp_path))},
                         headers=ADMIN)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


class RefusingEngine(SimulatedEngine):
    async def add_lora(self, ref: LoraRef, replace: bool = False) -> None:
        raise InvalidRequest("no room for adapters on this worker")


@pytest.mark.asyncio
async def test_a_worker_that_refuses_leaves_no_other_worker_loaded(tmp_path: Path) -> None:
    async with lora_app(tmp_path, workers=3) as (c, app):
        pool = app.state.gateway.models["sim"].pool
        pool.workers[2].engine = RefusingEngine(SimulatedConfig(lora=True))
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(fake_adapter(tmp_path))},
                         headers=ADMIN)
        assert r.status_code == 400 and "no room" in r.json()["error"]["message"]
        assert [e.loras for e in engines(app)[:2]] == [{}, {}]
        assert (await c.post("/v1/chat/completions", **chat("t"))).status_code == 404


@pytest.mark.asyncio
async def test_loaded_adapters_come_back_after_a_restart(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "tuned")
    gone = fake_adapter(tmp_path / "gone")
    async with lora_app(tmp_path) as (c, _):
        for name, p in (("tuned", path), ("gone", gone)):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(p)}, headers=ADMIN)
            assert r.status_code == 200
    saved = json.loads((tmp_path / "data" / "lora_adapters.json").read_text())
    assert [a["name"] for a in saved["adapters"]] == ["tuned", "gone"]
    (gone / "adapter_config.json").unlink()  # this one cannot come back
    async with lora_app(tmp_path) as (c, app):
        assert [sorted(ref.name for ref in e.loras.values()) for e in engines(app)] == [["tuned"], ["tuned"]]
        r = await c.post("/v1/chat/completions", **chat("tuned"))
        assert r.status_code == 200
        assert (await c.post("/v1/chat/completions", **chat("gone"))).status_code == 404
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=ADMIN)
        assert r.status_code == 200
    async with lora_app(tmp_path) as (c, _):
        assert (await c.post("/v1/chat/completions", **chat("tuned"))).status_code == 404


@pytest.mark.asyncio
async def test_lora_modules_flag_serves_from_the_start_and_is_not_persisted(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "a")
    spec = json.dumps({"name": "flagged", "path": str(path), "base_model_name": "sim"})
    async with lora_app(tmp_path, lora_modules=[f"plain={path}", spec]) as (c, _):
        ids = {m["id"]: m for m in (await c.get("/v1/models", headers=ADMIN)).json()["data"]}
        assert ids["plain"]["parent"] == ids["flagged"]["parent"] == "sim"
        assert (await c.post("/v1/chat/completions", **chat("flagged"))).status_code == 200
    assert not (tmp_path / "data" / "lora_adapters.json").exists()


@pytest.mark.asyncio
async def test_key_access_lists_cover_adapters(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "tuned")
    async with lora_app(tmp_path) as (c, _):
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(path)}, headers=ADMIN)
        assert r.status_code == 200
        r = await c.post("/v1/chat/completions", **chat("tuned", key="base-only"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
        assert (await c.post("/v1/chat/completions", **chat("sim", key="base-only"))).status_code == 200
        assert (await c.post("/v1/chat/completions", **chat("tuned", key="tuned"))).status_code == 200
        listed = (await c.get("/v1/models", headers={"Authorization": "Bearer sk-base-only"})).json()["data"]
        assert [m["id"] for m in listed] == ["sim"]


@pytest.mark.asyncio
async def test_aliases_target_adapters_and_guard_their_unload(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "tuned")
    async with lora_app(tmp_path) as (c, _):
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(path)}, headers=ADMIN)
        assert r.status_code == 200
        r = await c.post("/admin/routes", json={"aliases": {"prod": {"tuned": 1}}}, headers=ADMIN)
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", **chat("prod"))
        assert r.status_code == 200 and r.headers["x-npugw-served-by"] == "tuned"
        base = (await c.post("/v1/chat/completions", **chat("sim"))).json()["choices"][0]["message"]["content"]
        assert r.json()["choices"][0]["message"]["content"] != base
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=ADMIN)
        assert r.status_code == 400 and "prod" in r.json()["error"]["message"]


@pytest.mark.asyncio
async def test_metrics_per_adapter(tmp_path: Path) -> None:
    path = fake_adapter(tmp_path / "tuned")
    async with lora_app(tmp_path) as (c, _):
        await c.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(path)}, headers=ADMIN)
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", **chat("tuned"))).status_code == 200
        await c.post("/v1/chat/completions", **chat("sim"))
        text = (await c.get("/metrics")).text
        labels = {"adapter": "tuned", "base_model": "sim"}
        assert metric_value(text, "npugw_lora_requests_total", **labels) == 3
        assert metric_value(text, "npugw_lora_generation_tokens_total", **labels) == 12  # 3 x max_tokens 4
        assert metric_value(text, "npugw_lora_prompt_tokens_total", **labels) > 0
        assert metric_value(text, "npugw_lora_time_to_first_token_seconds_count", **labels) == 3


def test_prefix_policy_keys_differ_per_adapter() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
    ids = list(range(64))
    base, a, b = (p.key_for_tokens(ids, None, adapter=x) for x in (None, "a", "b"))
    assert len(base.blocks) == len(a.blocks) == 4
    assert not {*base.blocks} & {*a.blocks} and not {*a.blocks} & {*b.blocks}
    assert p.key_for_tokens(ids, None, adapter="a") == a
    body = {"messages": [{"role": "user", "content": "x" * 600}]}
    assert p.key_for_body(body, None, adapter="a").blocks != p.key_for_body(body, None).blocks
    # a request on adapter a lands where a's prefix went, not where the base's did
    p.choose([0, 1], [0, 0], base)
    assert p.choose([0, 1], [1, 0], a) == 1  # no match for a: least loaded


def test_lora_settings_and_engine_args(tmp_path: Path) -> None:
    assert parse_lora_module("a=/x/y").path == "/x/y"
    m = parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "base"}')
    assert (m.name, m.base_model_name) == ("a", "base")
    for bad in ("a=", '{"name": "a"}', "{nope"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="--enable-lora"):
        Settings(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max-lora-rank"):
        Settings(max_lora_rank=24)
    with pytest.raises(ValueError, match="engine-arg enable_lora"):
        Settings(engine_args=["enable_lora=true"])
    kw = VllmConfig(model="/m", served_model_name="m", enable_lora=True, max_loras=2, max_lora_rank=8).engine_kwargs(
        "cpu")
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"]) == (True, 2, 8)
    assert "enable_lora" not in VllmConfig(model="/m", served_model_name="m").engine_kwargs("cpu")


def adapter_node() -> FakeNode:
    """A node serving a base model and one LoRA adapter (its card has
    `parent`), answering with the model id it was asked for."""
    cards = [{"id": "node-base", "object": "model", "root": "/models/base", "parent": None, "max_model_len": 512},
             {"id": "node-tuned", "object": "model", "root": "/adapters/node-tuned", "parent": "node-base"}]
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    return FakeNode(cards, words=lambda body: [f"from {body['model']}"], usage=usage, usage_always=True)


@pytest.mark.asyncio
async def test_upstream_adapters_are_discovered_and_passed_through_by_name() -> None:
    node = await adapter_node().start()
    try:
        s = Settings(model="none", device="cpu", upstream=[f"remote={node.url};health_interval=0.2"],
                     upstream_health_interval=0.2)
        async with serve(None, s) as (c, app):
            cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert cards["node-tuned"]["parent"] == "remote" and cards["node-tuned"]["root"] == "/adapters/node-tuned"
            r = await c.post("/v1/chat/completions", json={"model": "node-tuned", "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "node-tuned" and r.json()["choices"][0]["message"]["content"] == \
                "from node-tuned"
            r = await c.post("/v1/chat/completions", json={"model": "node-tuned", "stream": True, "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and '"model":"node-tuned"' in r.text and "from node-tuned" in r.text
            r = await c.post("/v1/chat/completions", json={"model": "remote", "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and [c[1]["model"] for c in node.calls] == ["node-tuned", "node-tuned", "node-base"]
            text = (await c.get("/metrics")).text
            labels = {"adapter": "node-tuned", "base_model": "remote"}
            assert metric_value(text, "npugw_lora_requests_total", **labels) == 2
            assert metric_value(text, "npugw_lora_generation_tokens_total", **labels) == 4  # the node's usage
            node.models.pop()  # the node unloads the adapter: the gateway follows at the next checks
            await wait_until(lambda: "node-tuned" not in app.state.gateway.models, what="the adapter to be dropped")
            r = await c.post("/v1/chat/completions", json={"model": "node-tuned", "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.status_code == 404
    finally:
        assert node.runner is not None
        await node.runner.cleanup()
