"""Two real gateway processes: an upstream (simulated engine, serving
`qwen-v3`) and a front gateway serving `qwen-v2` locally and `qwen-v3`
through the remote backend, with the alias `chat-prod` over both and a
fallback to `qwen-v2`. Driven over HTTP with the OpenAI SDK and httpx."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from support import GatewayProcess, metric_value, wait_until, wait_until_sync

pytestmark = pytest.mark.e2e

ROUTES = "alias:\n  chat-prod: qwen-v2:50,qwen-v3:50\nfallback:\n  chat-prod: [qwen-v2]\n"
ADMIN = {"Authorization": "Bearer adm"}
COMMON = ["--backend", "simulated", "--embedding-model", "none", "--simulated-itl", "0.001"]


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.routes = tmp / "routes.yaml"
        self.routes.write_text(ROUTES)
        upstream_args = [*COMMON, "--served-model-name", "qwen-v3", "--max-model-len", "2048"]
        self.upstream = GatewayProcess(upstream_args, tmp / "upstream.log")
        self.front: GatewayProcess | None = None
        try:
            self.upstream.wait_ready(60, path="/health")
            upstream = (
                f"qwen-v3={self.upstream.url};connect_timeout=0.5;read_timeout=3;health_interval=0.5;"
                "eject_after=2;cooldown=30"
            )
            self.front = GatewayProcess(
                [*COMMON, "--served-model-name", "qwen-v2", "--upstream", upstream,
                 "--config", str(self.routes),
                 "--api-key", "k1", "--admin-api-key", "adm", "--readiness-interval", "2"],
                tmp / "front.log",
            )
            self.front.wait_ready(60, path="/health")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        assert self.front is not None
        return self.front.url

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.url + "/v1", api_key="k1", max_retries=0, timeout=20)

    def set_routes(self, aliases: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(self.url + "/admin/routes", json={"aliases": aliases}, headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
        self.upstream.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("routing-e2e"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def own_pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.stop()


MESSAGES: Any = [{"role": "user", "content": "Say something."}]


def admin_routes(pair: Pair) -> dict[str, Any]:
    aliases: dict[str, Any] = httpx.get(pair.url + "/admin/routes", headers=ADMIN).json()["aliases"]
    return aliases


async def metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(url + "/metrics")).text


@pytest.mark.asyncio
async def test_alias_listed_split_sticky_and_counted(pair: Pair) -> None:
    async with pair.client() as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert {"qwen-v2", "qwen-v3", "chat-prod"} <= set(models)
        alias = models["chat-prod"].model_dump()
        assert alias["parent"] in ("qwen-v2", "qwen-v3")
        assert [t["model"] for t in alias["targets"]] == ["qwen-v2", "qwen-v3"]
        assert alias["fallbacks"] == ["qwen-v2"]
        assert models["qwen-v3"].model_dump()["max_model_len"] == 2048  # learned from the upstream
        assert models["qwen-v2"].model_dump()["max_model_len"] == 4096
        assert alias["max_model_len"] == 2048  # the shortest context of its targets

        async def ask(session: str) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model="chat-prod", messages=MESSAGES, max_tokens=4, extra_headers={"X-Session-ID": session}
            )
            done = raw.parse()
            assert done.usage is not None and done.usage.completion_tokens == 4  # also through the remote
            assert done.choices[0].message.content
            return str(raw.headers["x-npugw-served-by"])

        first = await asyncio.gather(*(ask(f"s{i}") for i in range(16)))
        again = await asyncio.gather(*(ask(f"s{i}") for i in range(16)))
        assert first == again  # sticky per session
        assert set(first) == {"qwen-v2", "qwen-v3"}


@pytest.mark.asyncio
async def test_stream_through_the_remote_upstream(pair: Pair) -> None:
    route = "/v1/chat/completions"  # passed through as the same endpoint
    before = metric_value(await metrics(pair.upstream.url), "npugw_http_requests_total", route=route)
    pair.set_routes({"chat-prod": {"qwen-v2": 0, "qwen-v3": 100}})
    try:
        async with pair.client() as client:
            stream = await client.chat.completions.create(
                model="chat-prod", messages=MESSAGES, max_tokens=6, stream=True,
                stream_options={"include_usage": True},
            )
            assert stream.response.headers["x-npugw-served-by"] == "qwen-v3"
            text, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                usage = chunk.usage or usage
            assert "".join(text).strip() and usage is not None and usage.completion_tokens == 6
    finally:
        pair.set_routes({"chat-prod": {"qwen-v2": 50, "qwen-v3": 50}})
    after = metric_value(await metrics(pair.upstream.url), "npugw_http_requests_total", route=route)
    assert after >= before + 1


def test_sighup_reloads_the_settings_file(pair: Pair) -> None:
    assert pair.front is not None
    pair.routes.write_text("alias:\n  chat-prod: qwen-v2:1\n  beta: qwen-v3:1\n")
    try:
        pair.front.signal(signal.SIGHUP)
        wait_until_sync(lambda: "beta" in admin_routes(pair), timeout=5, what="the reloaded routes", interval=0.1)
        routes = admin_routes(pair)
        assert [t["model"] for t in routes["chat-prod"]["targets"]] == ["qwen-v2"]
        assert routes["chat-prod"]["fallbacks"] == [] and "beta" in routes
    finally:
        pair.routes.write_text(ROUTES)
        pair.front.signal(signal.SIGHUP)
        wait_until_sync(lambda: "beta" not in admin_routes(pair), timeout=5, what="the routes restored", interval=0.1)
    assert pair.front.proc.poll() is None and "SIGHUP: routes reloaded" in pair.front.log()


@pytest.mark.asyncio
async def test_dead_upstream_falls_back_and_is_ejected(own_pair: Pair) -> None:
    own_pair.set_routes({"chat-prod": {"qwen-v2": 0, "qwen-v3": 100}})
    own_pair.upstream.proc.kill()
    own_pair.upstream.proc.wait(10)
    async with own_pair.client() as client:
        for i in range(6):
            t0 = time.monotonic()
            raw = await client.chat.completions.with_raw_response.create(
                model="chat-prod", messages=MESSAGES, max_tokens=3, extra_headers={"X-Session-ID": f"d{i}"}
            )
            assert raw.headers["x-npugw-served-by"] == "qwen-v2"
            assert time.monotonic() - t0 < 2.0
        stream = await client.chat.completions.create(model="chat-prod", messages=MESSAGES, max_tokens=3, stream=True)
        assert stream.response.headers["x-npugw-served-by"] == "qwen-v2"
        assert [c async for c in stream]
    async def ejected() -> bool:
        return metric_value(await metrics(own_pair.url), "npugw_upstream_up", upstream="qwen-v3") == 0

    await wait_until(ejected, timeout=5, what="qwen-v3 ejected", interval=0.2)
    text = await metrics(own_pair.url)
    assert metric_value(text, "npugw_route_fallbacks_total", alias="chat-prod", reason="unavailable") >= 1
    assert metric_value(text, "npugw_route_requests_total", alias="chat-prod", target="qwen-v2", outcome="ok") >= 7
