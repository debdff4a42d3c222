"""The remote backend against real local HTTP servers: streaming and token
counts, errors, least-outstanding balancing, circuit breaker, health checks,
a black-holed upstream, a stream cut mid-way, and disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from support import free_port

from engine_adapter.backends.remote import UNKNOWN_TOKEN, RemoteEngine, build_remote_pool, completion_body
from engine_adapter.backends.simulated import ByteTokenizer
from engine_adapter.errors import EngineError, GatewayError, InvalidRequest, QueueFull, ServiceUnavailable
from engine_adapter.routing.upstream import Upstream, UpstreamConfig, parse_upstream
from engine_adapter.types import EngineOutput, GenerationRequest, SamplingOptions, StructuredOutput


def req(rid: str = "r", max_tokens: int = 4, **kw: Any) -> GenerationRequest:
    sampling = SamplingOptions(max_tokens=max_tokens, **kw)
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=(75, 108, 108), sampling=sampling)


class FakeUpstream:
    """A small OpenAI-compatible server streaming `/v1/completions` like vLLM."""

    def __init__(self, delay: float = 0.0, extra_usage: int = 0) -> None:
        self.delay = delay
        self.extra_usage = extra_usage  # usage says more tokens than chunks (multi-token chunks)
        self.status = 200
        self.health_status = 200
        self.bodies: list[dict[str, Any]] = []
        self.disconnects = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
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
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 777}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            error = {"error": {"message": "boom", "type": "internal_server_error", "code": self.status}}
            return web.json_response(error, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        try:
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                choice = {"index": 0, "text": f" w{i}", "finish_reason": "length" if i == n - 1 else None}
                await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n + self.extra_usage}
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            self.disconnects += 1
            raise
        return resp


class RawServer:
    """A TCP server with a scripted behaviour: `blackhole` accepts and never
    answers; `cut` sends two SSE events then closes the connection."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.eof = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def start(self) -> RawServer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            if self.mode == "cut":
                await reader.readuntil(b"\r\n\r\n")
                head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                writer.write(head)
                for i in range(2):
                    data = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                writer.close()
                return
            while await reader.read(65536):  # black hole: read all, answer nothing
                pass
            self.eof.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    f = await FakeUpstream().start()
    yield f
    await f.stop()


async def engine_for(*urls: str, **kw: Any) -> RemoteEngine:
    cfg = UpstreamConfig(name="m", urls=urls, **{"health_interval": 30.0, **kw})
    e = RemoteEngine(Upstream(cfg, ByteTokenizer()))
    await e.start()
    return e


async def collect(e: RemoteEngine, r: GenerationRequest) -> list[EngineOutput]:
    return [o async for o in e.generate(r)]


def test_parse_upstream_options_and_errors() -> None:
    cfg = parse_upstream("qwen=http://a:8000/v1/, http://b:8000;read_timeout=5;model=Qwen/Q;eject-after=2")
    assert cfg.urls == ("http://a:8000", "http://b:8000")
    assert (cfg.read_timeout, cfg.remote_model, cfg.eject_after) == (5.0, "Qwen/Q", 2)
    assert parse_upstream("x=http://h", connect_timeout=0.5, max_model_len=None).connect_timeout == 0.5
    for bad in ("x", "x=", "x=ftp://h", "x=http://h;bogus=1", "x=http://h;eject_after=0"):
        with pytest.raises(ValueError):
            parse_upstream(bad)


def test_completion_body_maps_sampling_and_structured_output() -> None:
    r = req(max_tokens=7, temperature=0.3, stop=("x",), logprobs=2, logit_bias=((5, 1.0),),
            structured=StructuredOutput(json_schema={"type": "object"}))
    body = completion_body(r, "remote-m")
    assert body["prompt"] == [75, 108, 108] and body["model"] == "remote-m" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["stop"], body["logprobs"]) == (7, 0.3, ["x"], 2)
    assert body["logit_bias"] == {"5": 1.0} and body["response_format"]["type"] == "json_schema"
    assert "top_k" not in body and "priority" not in body
    regex = completion_body(req(structured=StructuredOutput(regex="a+")), "m")
    assert regex["structured_outputs"] == {"regex": "a+"} and regex["guided_regex"] == "a+"


@pytest.mark.asyncio
async def test_streams_text_and_counts_tokens_from_usage(fake: FakeUpstream) -> None:
    fake.extra_usage = 2  # e.g. a chunk that held three tokens
    e = await engine_for(fake.url)
    try:
        outs = await collect(e, req(max_tokens=5))
    finally:
        await e.stop()
    assert "".join(o.text for o in outs) == " w0 w1 w2 w3 w4"
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert sum(len(o.token_ids) for o in outs) == 7 and set(outs[-1].token_ids) == {UNKNOWN_TOKEN}
    assert fake.bodies[0]["prompt"] == [75, 108, 108] and fake.bodies[0]["model"] == "m"


@pytest.mark.asyncio
async def test_error_statuses_map_to_gateway_errors(fake: FakeUpstream) -> None:
    e = await engine_for(fake.url, eject_after=10)
    try:
        for status, kind in ((500, ServiceUnavailable), (429, QueueFull), (400, InvalidRequest)):
            fake.status = status
            with pytest.raises(kind) as info:
                await collect(e, req())
            assert "boom" in info.value.message
        assert e.upstream.endpoints[0].failures == 1  # only the 500 counts against the upstream
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_unreachable_url_is_retried_on_the_other_one(fake: FakeUpstream) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    e = await engine_for(dead, fake.url, connect_timeout=0.5)
    try:
        for i in range(4):
            outs = await collect(e, req(f"r{i}", max_tokens=2))
            assert outs[-1].finish_reason == "length"
        assert e.upstream.endpoints[0].failures >= 1 and len(fake.bodies) == 4
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_least_outstanding_balancing() -> None:
    slow, fast = await FakeUpstream(delay=0.3).start(), await FakeUpstream().start()
    e = await engine_for(slow.url, fast.url)
    try:
        first = [asyncio.ensure_future(collect(e, req(f"a{i}", max_tokens=3))) for i in range(2)]
        await asyncio.sleep(0.15)  # the fast URL is done, the slow one still holds its request
        for i in range(4):
            await collect(e, req(f"b{i}", max_tokens=2))
        await asyncio.gather(*first)
        assert (len(slow.bodies), len(fast.bodies)) == (1, 5)
    finally:
        await e.stop()
        await slow.stop()
        await fast.stop()


@pytest.mark.asyncio
async def test_black_hole_upstream_fails_in_bounded_time_without_slowing_others(fake: FakeUpstream) -> None:
    hole = await RawServer("blackhole").start()
    bad = await engine_for(hole.url, read_timeout=0.3, eject_after=100)
    good = await engine_for(fake.url)
    t0 = time.monotonic()

    async def timed(e: RemoteEngine, rid: str) -> tuple[float, BaseException | None]:
        try:
            await collect(e, req(rid, max_tokens=2))
            return time.monotonic() - t0, None
        except GatewayError as err:
            return time.monotonic() - t0, err

    try:
        results = await asyncio.gather(
            *(timed(bad, f"bad{i}") for i in range(5)), *(timed(good, f"good{i}") for i in range(5))
        )
    finally:
        await bad.stop()
        await good.stop()
        await hole.stop()
    bad_r, good_r = results[:5], results[5:]
    assert all(isinstance(err, ServiceUnavailable) and err.code == "upstream_timeout" for _, err in bad_r)
    assert all(0.25 < t < 1.5 for t, _ in bad_r), bad_r
    assert all(err is None and t < 0.25 for t, err in good_r), good_r
    assert hole.connections >= 5  # and one health check


@pytest.mark.asyncio
async def test_stream_cut_mid_way_is_a_clean_error() -> None:
    cut = await RawServer("cut").start()
    e = await engine_for(cut.url)
    got: list[str] = []
    try:
        with pytest.raises(EngineError) as info:
            async for out in e.generate(req(max_tokens=8)):
                got.append(out.text)
    finally:
        await e.stop()
        await cut.stop()
    assert got == ["t0", "t1"] and info.value.code == "upstream_disconnected"


@pytest.mark.asyncio
async def test_circuit_breaker_opens_half_opens_and_closes(fake: FakeUpstream) -> None:
    e = await engine_for(fake.url, eject_after=2, cooldown=0.3)
    ep = e.upstream.endpoints[0]
    try:
        fake.status = 500
        for _ in range(2):
            with pytest.raises(ServiceUnavailable):
                await collect(e, req())
        assert ep.state == "open"
        with pytest.raises(ServiceUnavailable) as info:  # fails fast, the upstream sees nothing
            await collect(e, req())
        assert info.value.code == "upstream_ejected" and len(fake.bodies) == 2
        await asyncio.sleep(0.35)  # half-open: one trial; it fails, so open again
        with pytest.raises(ServiceUnavailable):
            await collect(e, req())
        assert ep.state == "open" and len(fake.bodies) == 3
        await asyncio.sleep(0.35)
        fake.status, fake.delay = 200, 0.05
        trial = asyncio.ensure_future(collect(e, req("trial", max_tokens=2)))
        await asyncio.sleep(0.02)
        with pytest.raises(ServiceUnavailable):  # only one trial at a time
            await collect(e, req("second"))
        assert (await trial)[-1].finish_reason == "length"
        assert ep.state == "closed" and ep.failures == 0 and ep.ejections == 2
        assert len(await collect(e, req("after"))) == 4
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_health_checks_eject_and_restore_and_learn_the_context_length(fake: FakeUpstream) -> None:
    e = await engine_for(fake.url, health_interval=0.05, eject_after=2)
    ep = e.upstream.endpoints[0]
    try:
        await asyncio.sleep(0.1)
        assert e.card.max_model_len == 777
        fake.health_status = 503
        await asyncio.sleep(0.2)
        assert not ep.healthy
        with pytest.raises(ServiceUnavailable):
            await e.health()
        fake.health_status = 200
        await asyncio.sleep(0.15)
        assert ep.healthy
        await e.health()
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_client_disconnect_closes_the_upstream_connection(fake: FakeUpstream) -> None:
    fake.delay = 0.05
    pool = build_remote_pool(
        UpstreamConfig(name="m", urls=(fake.url,), health_interval=30), tokenizer=ByteTokenizer(),
        readiness_interval=60,
    )
    await pool.start()
    try:
        consumer = pool.generate(req("long", max_tokens=100))
        first = await consumer.__anext__()
        assert first is not None and first.text == " w0"
        await consumer.aclose()  # what a client disconnect does to the HTTP handler's stream
        for _ in range(40):
            if fake.disconnects:
                break
            await asyncio.sleep(0.025)
        assert fake.disconnects == 1
        assert pool.running == 0 and pool.workers[0].engine.stats().running == 0
    finally:
        await pool.stop()


@pytest.mark.asyncio
async def test_error_event_before_the_first_token_can_fall_back(fake: FakeUpstream) -> None:
    async def error_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n")
        error = {"error": {"message": "queue wait too long", "type": "service_unavailable"}}
        await resp.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", error_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    e = await engine_for(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(ServiceUnavailable) as info:
            await collect(e, req())
        assert "queue wait too long" in info.value.message
    finally:
        await e.stop()
        await runner.cleanup()
