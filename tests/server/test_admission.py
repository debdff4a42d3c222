"""Admission before the response, on a real uvicorn socket and simulated
engines: overload, queue wait, draining, unknown models and fallbacks answer
streamed requests with a status and headers before any SSE byte; admitted
streams run to `[DONE]`; a client that leaves while queued leaves nothing
behind. Plus the generation core's token accounting, shared by chat and
completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from sim_app import serve
from support import metric_value, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineError
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, GenerationRequest
from server.app import create_app
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}


def sim_pool(name: str, cfg: SimulatedConfig, **kw: Any) -> WorkerPool:
    return WorkerPool(name, lambda i: SimulatedEngine(cfg, name=name), readiness_interval=60, **kw)


async def post_stream(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[
    httpx.Response, bytes
]:
    async with client.stream("POST", path, json=body) as r:
        raw = await r.aread()
    return r, raw


def sse_events(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]", raw[-200:]
    return [orjson.loads(e[6:]) for e in events[:-1]]


def assert_refused(r: httpx.Response, raw: bytes, status: int, code: str) -> None:
    """A refusal: the status, Retry-After, an OpenAI error body, no SSE."""
    assert r.status_code == status, raw
    assert r.headers["content-type"].startswith("application/json")
    assert int(r.headers["retry-after"]) >= 1
    assert not raw.startswith(b"data:") and b"[DONE]" not in raw
    err = orjson.loads(raw)["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}


@pytest.mark.asyncio
async def test_stream_overload_gets_429_before_any_byte_and_admitted_streams_finish() -> None:
    pool = sim_pool("sim", SimulatedConfig(itl=0.05), slots_per_worker=2, max_queue_size=2)
    async with serve([(pool, ("sim",), "sim")]) as (client, _app):
        results = await asyncio.gather(*(post_stream(client, CHAT) for _ in range(12)))
        ok = [raw for r, raw in results if r.status_code == 200]
        refused = [(r, raw) for r, raw in results if r.status_code != 200]
        assert len(ok) >= 4 and refused, [r.status_code for r, _ in results]  # 2 running + 2 queued at least
        for raw in ok:
            chunks = sse_events(raw)
            assert not any("error" in c for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert len(text.split()) == 20
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        for r, raw in refused:
            assert_refused(r, raw, 429, "queue_full")
            assert orjson.loads(raw)["error"]["type"] == "rate_limit_error"
        metrics = (await client.get("/metrics")).text
        assert metric_value(metrics, "npugw_admission_rejections_total", model_name="sim", reason="queue_full") == len(refused)
        assert metric_value(metrics, "npugw_http_requests_total", route="/v1/chat/completions", method="POST",
                            status="429") == len(refused)
        await wait_until(lambda: pool.running == 0 and pool.queue_depth == 0, what="the pool to drain")


@pytest.mark.asyncio
async def test_stream_queue_wait_draining_and_unknown_model_are_statuses() -> None:
    pool = sim_pool("sim", SimulatedConfig(itl=0.05), slots_per_worker=1, max_queue_size=4, max_queue_wait=0.1)
    async with serve([(pool, ("sim",), "sim")]) as (client, app):
        long = asyncio.ensure_future(post_stream(client, {**CHAT, "max_tokens": 40}))
        await wait_until(lambda: pool.running == 1, what="the first stream to run")
        r, raw = await post_stream(client, CHAT)
        assert_refused(r, raw, 503, "queue_timeout")
        r, raw = await post_stream(client, {**CHAT, "model": "nope"})
        assert r.status_code == 404 and orjson.loads(raw)["error"]["code"] == "model_not_found"
        app.state.gateway.begin_drain()
        r, raw = await post_stream(client, CHAT)
        assert_refused(r, raw, 503, "shutting_down")
        first, first_raw = await long
        assert first.status_code == 200 and len(sse_events(first_raw)) > 40  # it finished while draining


@pytest.mark.asyncio
async def test_a_client_that_leaves_while_queued_leaves_no_waiter() -> None:
    pool = sim_pool("sim", SimulatedConfig(itl=0.05), slots_per_worker=1, max_queue_size=4, max_queue_wait=30)
    async with serve([(pool, ("sim",), "sim")]) as (client, _):
        long = asyncio.ensure_future(post_stream(client, {**CHAT, "max_tokens": 30}))
        await wait_until(lambda: pool.running == 1, what="the first stream to run")
        queued = asyncio.ensure_future(post_stream(client, CHAT))
        await wait_until(lambda: pool.queue_depth == 1, what="the second request to queue")
        queued.cancel()  # the client closes its connection while waiting
        await asyncio.gather(queued, return_exceptions=True)
        await wait_until(lambda: pool.queue_depth == 0, what="the waiter to leave the queue")
        r, _raw = await long
        assert r.status_code == 200
        await wait_until(lambda: pool.running == 0 and pool.workers[0].in_flight == 0, what="the slot to be free")


@pytest.mark.asyncio
async def test_fallback_at_admission_is_named_in_the_headers() -> None:
    primary = sim_pool("primary", SimulatedConfig(itl=0.05), slots_per_worker=1, max_queue_size=0)
    backup = sim_pool("backup", SimulatedConfig(itl=0.001))
    settings = Settings(fallback=["primary=backup"])
    pools = [(primary, ("primary",), "primary"), (backup, ("backup",), "backup")]
    async with serve(pools, settings) as (client, _):
        body = {**CHAT, "model": "primary"}
        blocker = asyncio.ensure_future(post_stream(client, {**body, "max_tokens": 40}))
        await wait_until(lambda: primary.running == 1, what="the primary to be busy")
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["x-npugw-served-by"] == "backup"  # known before the first byte
            raw = await r.aread()
        assert {c["model"] for c in sse_events(raw)} == {"backup"}
        first, first_raw = await blocker
        assert first.headers["x-npugw-served-by"] == "primary"
        assert {c["model"] for c in sse_events(first_raw)} == {"primary"}
        metrics = (await client.get("/metrics")).text
        assert metric_value(metrics, "npugw_route_fallbacks_total", alias="primary", to_target="backup",
                            reason="queue_full") == 1


class CachedEngine(SimulatedEngine):
    """Reports cached prompt tokens and a stop string; optionally fails after
    `fail_after` tokens."""

    def __init__(self, cfg: SimulatedConfig, fail_after: int | None = None) -> None:
        super().__init__(cfg, name="sim")
        self.fail_after = fail_after

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        n = 0
        async for out in super().generate(req):
            out.cached_tokens = 2
            if out.finished:
                out.finish_reason, out.stop_reason = "stop", "</s>"
            if self.fail_after is not None and n == self.fail_after:
                raise EngineError("boom")
            n += 1
            yield out


@asynccontextmanager
async def in_process(make: Callable[[int], SimulatedEngine], keys: bool = True) -> AsyncIterator[
    tuple[httpx.AsyncClient, Any]
]:
    app = create_app(Settings(api_key=["sk-a"]) if keys else Settings(),
                     pools=[(WorkerPool("sim", make, readiness_interval=60), ("sim",), "sim")])
    async with app.router.lifespan_context(app):
        headers = {"Authorization": "Bearer sk-a"} if keys else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     headers=headers) as client:
            yield client, app


async def prompt_len(client: httpx.AsyncClient, prompt: str) -> int:
    r = await client.post("/tokenize", json={"model": "sim", "prompt": prompt})
    return int(r.json()["count"])


def key_tokens(metrics: str, kind: str) -> float:
    return metric_value(metrics, "npugw_api_key_tokens_total", api_key_name="key-1", model_name="sim", type=kind)


@pytest.mark.asyncio
async def test_completions_report_cached_tokens_and_stop_reason_like_chat() -> None:
    async with in_process(lambda i: CachedEngine(SimulatedConfig())) as (client, _):
        r = await client.post("/v1/completions", json={"model": "sim", "prompt": ["ab", "cd"], "max_tokens": 3})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "text_completion"
        prompt = 2 * await prompt_len(client, "ab")
        assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6,
                                 "prompt_tokens_details": {"cached_tokens": 4}}  # 2 per prompt
        assert [c["stop_reason"] for c in body["choices"]] == ["</s>", "</s>"]
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3,
                                                            "stream_options": {"include_usage": True}})
        chunks = sse_events(r.content)
        assert all("stop_reason" in c["choices"][0] for c in chunks if c["choices"])
        assert chunks[-2]["choices"][0]["stop_reason"] == "</s>"
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.asyncio
async def test_completions_streamed_prompts_and_choices_interleave_with_their_own_indexes() -> None:
    async with in_process(lambda i: SimulatedEngine(SimulatedConfig(itl=0.001)), keys=False) as (client, _):
        body = {"model": "sim", "prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "stream": True, "echo": True,
                "logprobs": 1, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200
        chunks = sse_events(r.content)
        texts: dict[int, str] = {}
        for c in chunks[:-1]:
            assert c["object"] == "text_completion" and c["model"] == "sim"
            ch = c["choices"][0]
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            assert ch["logprobs"] is not None
        assert sorted(texts) == [0, 1, 2, 3]
        assert texts[0].startswith("ab") and texts[2].startswith("cd")  # echo, once per choice
        assert texts[0].count("ab") == 1
        assert chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_request_charges_what_was_generated(stream: bool) -> None:
    async with in_process(lambda i: CachedEngine(SimulatedConfig(), fail_after=2)) as (client, app):
        r = await client.post("/v1/completions", json={"model": "sim", "prompt": "abc", "max_tokens": 5,
                                                       "stream": stream})
        if stream:
            assert r.status_code == 200 and sse_events(r.content)[-1]["error"]["code"] == "engine_error"
        else:
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        metrics = (await client.get("/metrics")).text
        assert key_tokens(metrics, "prompt") == await prompt_len(client, "abc")
        assert key_tokens(metrics, "completion") == 2
        pool = app.state.gateway.pools[0]
        assert pool.running == 0 and pool.workers[0].in_flight == 0


@pytest.mark.asyncio
async def test_a_failure_before_the_first_token_is_a_status_even_for_a_stream() -> None:
    async with in_process(lambda i: CachedEngine(SimulatedConfig(), fail_after=0)) as (client, app):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "engine_error" and b"data:" not in r.content
        pool = app.state.gateway.pools[0]
        assert pool.running == 0 and pool.workers[0].in_flight == 0


@pytest.mark.asyncio
async def test_an_engine_failure_before_the_first_token_falls_back_before_the_status_line() -> None:
    broken = WorkerPool("broken", lambda i: CachedEngine(SimulatedConfig(), fail_after=0), readiness_interval=60)
    backup = sim_pool("backup", SimulatedConfig())
    pools = [(broken, ("broken",), "broken"), (backup, ("backup",), "backup")]
    async with serve(pools, Settings(fallback=["broken=backup"])) as (client, _):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "model": "broken"}) as r:
            assert r.status_code == 200 and r.headers["x-npugw-served-by"] == "backup"
            raw = await r.aread()
        assert {c["model"] for c in sse_events(raw)} == {"backup"}
