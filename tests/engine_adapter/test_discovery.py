"""Discovery and model choice over upstream nodes (docs/upstream-discovery.md),
against small aiohttp nodes whose `/v1/models` the tests change: `--upstream
URL[,URL...]` serves every model the nodes list and follows their lists;
`NAME=URL` on an npu-gateway-shaped node (a generator and an embedding
model, with their `kind`) sends each API to the right one; a malformed or
empty listing takes no traffic and is named in the log (once), in
/admin/routes and in the refusal; never a 500."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from sim_app import serve
from support import free_port, metric_value, wait_until

from engine_adapter.routing.node_models import NotListed, choose, read_listing
from engine_adapter.routing.upstream import parse_upstream
from server.settings import Settings

GEN, EMB = "SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"
# what a default npu-gateway node lists (server/routes/models.py), and a `vllm serve` one
GATEWAY_CARDS = [{"id": GEN, "object": "model", "max_model_len": 8192, "kind": "generate", "parent": None},
                 {"id": EMB, "object": "model", "max_model_len": 256, "kind": "embed", "parent": None}]
VLLM_CARDS = [{"id": "Qwen/Qwen3-8B", "object": "model", "owned_by": "vllm", "root": "/models/qwen",
               "parent": None, "max_model_len": 4096}]
ADMIN = {"Authorization": "Bearer adm"}
MSGS = [{"role": "user", "content": "hi"}]


class FakeNode:
    """An OpenAI-shaped node: `/v1/models` answers `listing` (cards, or raw
    bytes for a malformed one); generation and embeddings answer with the
    model they were sent, and record it."""

    def __init__(self, cards: list[dict[str, Any]]) -> None:
        self.listing: list[dict[str, Any]] | bytes = cards
        self.calls: list[tuple[str, str]] = []  # (path, model)
        self.listings = 0  # /v1/models reads (the health checks)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeNode:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        for path in ("/v1/chat/completions", "/v1/embeddings"):
            app.router.add_post(path, self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        self.listings += 1
        if isinstance(self.listing, bytes):
            return web.Response(body=self.listing, content_type="application/json")
        return web.json_response({"object": "list", "data": self.listing})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body["model"]
        self.calls.append((request.path, model))
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if request.path == "/v1/embeddings":
            return web.json_response({"object": "list", "model": model, "usage": usage,
                                      "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}]})
        head = {"id": "c1", "created": 1, "model": model}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": f"from {self.url}"}
            return web.json_response({**head, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, end in (({"role": "assistant", "content": "Par"}, None), ({"content": "is"}, "stop")):
            chunk = {**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": end}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[list[FakeNode]]:
    started = [await FakeNode(list(GATEWAY_CARDS)).start(), await FakeNode([dict(GATEWAY_CARDS[0])]).start()]
    yield started
    for n in started:
        await n.stop()


def front(*upstreams: str) -> Settings:
    return Settings(model="none", upstream=list(upstreams), readiness_interval=1, admin_api_key="adm",
                    upstream_health_interval=0.1)


def test_an_upstream_without_a_name_discovers_and_is_named_after_its_first_url() -> None:
    cfg = parse_upstream("http://node-a:8000, http://node-b:8000/v1;slots=4")
    assert (cfg.name, cfg.urls, cfg.model, cfg.slots) == (
        "node-a:8000", ("http://node-a:8000", "http://node-b:8000"), "*", 4)
    assert cfg.discovers and parse_upstream("tier=http://a:1;model=*").discovers
    assert not parse_upstream("tier=http://a:1").discovers
    with pytest.raises(ValueError, match="needs a name"):
        parse_upstream("http://a:1;model=x")


@pytest.mark.parametrize(("body", "reason"), [
    ([1, 2], "malformed"), ({"data": "x"}, "malformed"), ({"object": "list"}, "malformed"), (None, "malformed"),
])
def test_a_malformed_listing_is_named(body: Any, reason: str) -> None:
    with pytest.raises(NotListed, match=reason):
        read_listing(body)


def test_the_model_a_named_upstream_sends_to() -> None:
    gateway = read_listing({"data": GATEWAY_CARDS})
    chosen = choose(gateway, "remote", None)  # a default npu-gateway node: it says which is which
    assert (chosen.card["id"], chosen.embed_id) == (GEN, EMB)
    assert choose(gateway, EMB, None).card["id"] == EMB and choose(gateway, EMB, None).embed_id is None
    assert choose(read_listing({"data": VLLM_CARDS}), "remote", None).card["id"] == "Qwen/Qwen3-8B"
    unsaid = read_listing({"data": [{"id": "a"}, {"id": "b"}]})  # nothing says which is which
    with pytest.raises(NotListed, match=r"serves several models \(a, b\): pick one with ;model=ID"):
        choose(unsaid, "remote", None)
    two_gens = read_listing({"data": [*GATEWAY_CARDS, {"id": "x", "kind": "generate"}]})
    with pytest.raises(NotListed, match="serves several models"):
        choose(two_gens, "remote", None)
    with pytest.raises(NotListed, match="does not serve any model"):
        choose(read_listing({"data": []}), "remote", None)


@pytest.mark.asyncio
async def test_discovery_serves_every_listed_model_and_shares_an_id_between_nodes(nodes: list[FakeNode]) -> None:
    a, b = nodes  # a: generator + embedding model; b: the generator only
    async with serve(None, front(f"{a.url},{b.url}")) as (client, _):
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert sorted(listed) == sorted([GEN, EMB])  # the node's own ids; the upstream's name is none of them
        assert listed[EMB]["kind"] == "embed" and listed[EMB]["max_model_len"] == 256
        for _ in range(6):
            r = await client.post("/v1/chat/completions", json={"model": GEN, "messages": MSGS})
            assert r.status_code == 200 and r.json()["model"] == GEN
        assert [m for _, m in a.calls] == [GEN] * 3 and [m for _, m in b.calls] == [GEN] * 3  # shared
        r = await client.post("/v1/embeddings", json={"model": EMB, "input": "hello"})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.6, 0.8]
        assert a.calls[-1] == ("/v1/embeddings", EMB) and ("/v1/embeddings", EMB) not in b.calls  # only a lists it
        r = await client.post("/v1/chat/completions", json={"model": GEN, "messages": MSGS, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"content":"Par"' in r.text
        routes = (await client.get("/admin/routes", headers=ADMIN)).json()["upstreams"]
        assert routes[0]["upstream"] == a.url.removeprefix("http://")
        assert [sorted(u["serves"]) for u in routes[0]["urls"]] == [sorted([GEN, EMB]), [GEN]]
        metrics = (await client.get("/metrics")).text
        label = a.url.removeprefix("http://")
        assert metric_value(metrics, "npugw_upstream_listed_models", upstream=label, url=a.url) == 2
        assert metric_value(metrics, "npugw_upstream_listed_models", upstream=label, url=b.url) == 1


@pytest.mark.asyncio
async def test_a_model_that_appears_is_routed_and_one_that_disappears_is_dropped(
    nodes: list[FakeNode], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = nodes
    caplog.set_level(logging.INFO)
    async with serve(None, front(f"{a.url},{b.url}")) as (client, app):
        gw = app.state.gateway
        b.listing = [*b.listing, {"id": "new-model", "object": "model", "max_model_len": 1024}]
        await wait_until(lambda: "new-model" in gw.models, what="the new model to be served")
        r = await client.post("/v1/chat/completions", json={"model": "new-model", "messages": MSGS})
        assert r.status_code == 200 and b.calls[-1] == ("/v1/chat/completions", "new-model")
        assert f"{b.url}: lists model 'new-model': routable" in caplog.text
        assert "model new-model: served by upstream" in caplog.text
        a.listing = [GATEWAY_CARDS[0]]  # a drops the embedding model: no node lists it now
        await wait_until(lambda: EMB not in gw.models, what="the embedding model to be dropped")
        r = await client.post("/v1/embeddings", json={"model": EMB, "input": "hello"})
        assert r.status_code == 404, r.text
        assert f"{a.url}: no longer lists model '{EMB}'" in caplog.text
        b.listing = [GATEWAY_CARDS[0]]  # b drops new-model: gone as well, the generator stays on both
        await wait_until(lambda: "new-model" not in gw.models, what="new-model to be dropped")
        assert GEN in gw.models


@pytest.mark.asyncio
async def test_a_node_that_lists_nothing_or_garbage_takes_no_traffic_and_says_why(
    nodes: list[FakeNode], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = nodes
    bad = await FakeNode([]).start()
    bad.listing = b'{"data": "not a list"}'
    empty = await FakeNode([]).start()
    caplog.set_level(logging.INFO)
    try:
        async with serve(None, front(f"{a.url},{bad.url}", f"broken={bad.url}", f"hollow={empty.url}")) as (
            client, _
        ):
            for _ in range(4):
                r = await client.post("/v1/chat/completions", json={"model": GEN, "messages": MSGS})
                assert r.status_code == 200
            assert bad.calls == [] and len(a.calls) == 4
            routes = {u["upstream"]: u["urls"] for u in (await client.get("/admin/routes", headers=ADMIN)).json()
                      ["upstreams"]}
            discovered = {u["url"]: u for u in routes[a.url.removeprefix("http://")]}
            assert "/v1/models is malformed" in discovered[bad.url]["last_error"]
            assert not discovered[bad.url]["healthy"] and discovered[a.url]["healthy"]
            assert "/v1/models is empty" in routes["hollow"][0]["last_error"]
            for name, node, reason in (("broken", bad, "/v1/models is malformed"),
                                       ("hollow", empty, "does not serve any model")):
                r = await client.post("/v1/chat/completions", json={"model": name, "messages": MSGS})
                assert r.status_code == 503, r.text  # a refusal with the cause, never a 500
                message = r.json()["error"]["message"]
                assert f"upstream {name!r}: every URL is ejected: {node.url}: {reason}" in message, message
            seen = bad.listings
            await wait_until(lambda: bad.listings >= seen + 6, what="more health checks of the bad node")
            for label in ("broken", a.url.removeprefix("http://")):  # once per upstream, however many checks
                assert caplog.text.count(f"upstream {label} {bad.url}: /v1/models is malformed") == 1
    finally:
        await bad.stop()
        await empty.stop()


@pytest.mark.asyncio
async def test_a_taken_name_is_not_taken_over_and_an_alias_keeps_a_gone_model_with_the_reason(
    nodes: list[FakeNode], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = nodes
    caplog.set_level(logging.INFO)
    settings = front(f"{GEN}={b.url}", a.url)  # GEN is a named upstream already: a's GEN is not served from a
    settings.alias = [f"embedder={EMB}"]
    async with serve(None, settings) as (client, app):
        gw = app.state.gateway
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json={"model": GEN, "messages": MSGS})
            assert r.status_code == 200
        assert len(b.calls) == 2 and a.calls == []
        assert caplog.text.count(f"model {GEN} listed by upstream {a.url.removeprefix('http://')}: the name is "
                                 "served here already") == 1
        r = await client.post("/v1/embeddings", json={"model": "embedder", "input": "x"})
        assert r.status_code == 200 and a.calls[-1] == ("/v1/embeddings", EMB)
        a.listing = [GATEWAY_CARDS[0]]  # EMB disappears, but the alias names it
        await wait_until(lambda: "no upstream node lists it any more; still served for the aliases" in caplog.text,
                         what="the gone model to be kept for its alias")
        assert EMB in gw.models
        r = await client.post("/v1/embeddings", json={"model": EMB, "input": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_model_unlisted", r.text
        assert f"no URL lists model {EMB!r} now" in r.json()["error"]["message"]
