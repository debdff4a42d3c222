"""The remote backend against real local HTTP servers: streaming and token
counts, errors, least-outstanding balancing, circuit breaker, health checks,
a black-holed upstream, a stream cut mid-way, and disconnects; the SSE parser
over scripted network reads (one merged delta per choice and read); and the
non-streamed upstream call of clients that do not stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from support import free_port

from engine_adapter.backends.openai_wire import split_tokens
from engine_adapter.backends.remote import UNKNOWN_TOKEN, RemoteEngine, build_remote_pool, completion_body
from engine_adapter.backends.simulated import ByteTokenizer
from engine_adapter.errors import EngineError, GatewayError, InvalidRequest, QueueFull, ServiceUnavailable
from engine_adapter.routing.upstream import Upstream, UpstreamConfig, parse_upstream
from engine_adapter.types import EngineOutput, GenerationRequest, SamplingOptions, StructuredOutput


def req(rid: str = "r", max_tokens: int = 4, **kw: Any) -> GenerationRequest:
    sampling = SamplingOptions(max_tokens=max_tokens, **kw)
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=(75, 108, 108), sampling=sampling)


class FakeUpstream:
    """A small OpenAI-compatible server answering `/v1/completions` like vLLM:
    streamed (one write per token step, or the whole stream in one write with
    `burst`) or, for `"stream": false`, one JSON body. Choice j generates
    max_tokens - j tokens: choice 0 stops for length, the others with a stop."""

    def __init__(self, delay: float = 0.0, extra_usage: int = 0) -> None:
        self.delay = delay
        self.extra_usage = extra_usage  # usage says more tokens than chunks (multi-token chunks)
        self.burst = False
        self.cached = 0
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

    @staticmethod
    def tokens(body: dict[str, Any]) -> list[list[str]]:
        m = body["max_tokens"]
        return [[f" w{i}" if j == 0 else f" w{i}.{j}" for i in range(max(1, m - j))] for j in range(body.get("n", 1))]

    @staticmethod
    def logprobs(body: dict[str, Any], toks: list[str]) -> dict[str, Any] | None:
        if body.get("logprobs") is None:
            return None
        return {"tokens": toks, "token_logprobs": [-0.5] * len(toks), "top_logprobs": [{t: -0.5} for t in toks]}

    def usage(self, body: dict[str, Any], tokens: list[list[str]]) -> dict[str, Any]:
        details = {"cached_tokens": self.cached} if self.cached else None
        return {"prompt_tokens": len(body["prompt"]), "completion_tokens": sum(map(len, tokens)) + self.extra_usage,
                "prompt_tokens_details": details}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            error = {"error": {"message": "boom", "type": "internal_server_error", "code": self.status}}
            return web.json_response(error, status=self.status)
        tokens = self.tokens(body)
        if body.get("stream") is False:
            return await self.whole(request, body, tokens)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        held: list[bytes] = []
        try:
            for i in range(max(map(len, tokens))):
                if self.delay:
                    await asyncio.sleep(self.delay)
                step = b""
                for j, toks in enumerate(tokens):
                    if i < len(toks):
                        reason = None if i < len(toks) - 1 else "length" if j == 0 else "stop"
                        choice = {"index": j, "text": toks[i], "logprobs": self.logprobs(body, toks[i:i + 1]),
                                  "finish_reason": reason, "stop_reason": None}
                        step += b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"
                if self.burst:
                    held.append(step)
                else:
                    await resp.write(step)
            usage = self.usage(body, tokens)
            held.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
            await resp.write(b"".join(held))
        except (ConnectionResetError, ConnectionError):
            self.disconnects += 1
            raise
        return resp

    async def whole(self, request: web.Request, body: dict[str, Any], tokens: list[list[str]]) -> web.Response:
        for _ in range(max(map(len, tokens))):
            if self.delay:
                await asyncio.sleep(self.delay)
            if request.transport is None or request.transport.is_closing():
                self.disconnects += 1
                return web.Response(status=499)
        choices = [
            {"index": j, "text": "".join(toks), "logprobs": self.logprobs(body, toks),
             "finish_reason": "length" if j == 0 else "stop", "stop_reason": None}
            for j, toks in enumerate(tokens)
        ]
        answer = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices,
                  "usage": self.usage(body, tokens)}
        return web.json_response(answer)


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
    assert "".join(got) == "t0t1" and info.value.code == "upstream_disconnected"  # one delta per read


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


# ---- one delta per network read ---------------------------------------------
class ScriptedResponse:
    """What `RemoteEngine._read` uses of an aiohttp response, with the network
    reads scripted: each item of `reads` is what one `iter_any()` step gives;
    `at` is the read being handled (len(reads) once the stream ended)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.content = self
        self.at = 0
        self.released = False

    async def iter_any(self) -> AsyncIterator[bytes]:
        for k, chunk in enumerate(self.reads):
            self.at = k
            yield chunk
        self.at = len(self.reads)

    def release(self) -> None:
        self.released = True


def sse(*events: dict[str, Any], done: bool = False) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(ev) + b"\n\n" for ev in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def delta(index: int, text: str, reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "text": text, "finish_reason": reason, "stop_reason": None, **extra}]}


def usage_event(completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    details = {"cached_tokens": cached} if cached else None
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens,
                                     "prompt_tokens_details": details}}


async def read_script(reads: list[bytes], n: int = 1) -> tuple[list[list[EngineOutput]], ScriptedResponse]:
    """The outputs of `_read` over scripted reads, grouped by the read that
    let them out (a group per read; the last group: after the stream ended)."""
    e = RemoteEngine(Upstream(UpstreamConfig(name="m", urls=("http://x",)), ByteTokenizer()))
    resp = ScriptedResponse(reads)
    groups: list[list[EngineOutput]] = [[] for _ in range(len(reads) + 1)]
    async for out in e._read(e.upstream.endpoints[0], cast(Any, resp), req(max_tokens=64, n=n)):
        groups[resp.at].append(out)
    return groups, resp


@pytest.mark.asyncio
async def test_events_of_one_read_merge_into_one_delta_per_choice() -> None:
    first = sse(delta(0, "a"), delta(1, "x"), delta(0, "b"), delta(0, "c"), delta(1, "y"))
    second = sse(delta(1, "z"))
    last = sse(delta(0, "d"), delta(0, "e", "length"), delta(1, "!", "stop"), usage_event(11, cached=2), done=True)
    groups, resp = await read_script([first, second, last], n=2)
    assert [(o.index, o.text, len(o.token_ids), o.finish_reason) for o in groups[0]] == [
        (0, "abc", 3, None), (1, "xy", 2, None),
    ]
    assert [(o.index, o.text, len(o.token_ids)) for o in groups[1]] == [(1, "z", 1)]
    # the last read: its deltas join their choice's finishing delta; the usage's 11 tokens are exact
    assert [(o.index, o.text, o.finish_reason) for o in groups[2] + groups[3]] == [(0, "de", "length"), (1, "!", "stop")]
    outs = [o for g in groups for o in g]
    assert sum(len(o.token_ids) for o in outs) == 11 and set().union(*(o.token_ids for o in outs)) == {UNKNOWN_TOKEN}
    assert sum(o.cached_tokens for o in outs) == 2 and resp.released


@pytest.mark.asyncio
async def test_a_whole_stream_in_one_read_is_one_output_with_the_exact_count() -> None:
    events = [delta(0, f" t{i}", None if i < 63 else "length") for i in range(64)]
    lp = {"tokens": ["p", "q"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"p": -1.0}, {"q": -2.0}]}
    events[5] = delta(0, "pq", logprobs=lp)  # a two-token event, counted by its logprobs
    groups, _ = await read_script([sse(*events, usage_event(70), done=True)])
    outs = [o for g in groups for o in g]
    assert len(outs) == 1 and outs[0].finish_reason == "length"
    assert outs[0].text == "".join(ev["choices"][0]["text"] for ev in events)
    assert len(outs[0].token_ids) == 70 and outs[0].logprobs is not None
    assert [lp.token for lp in outs[0].logprobs if lp is not None] == ["p", "q"]


@pytest.mark.asyncio
async def test_an_event_split_across_reads_still_parses() -> None:
    body = sse(delta(0, "hé"), delta(0, "llo"), delta(0, "!", "stop"), usage_event(3), done=True)
    cut1 = body.index(b"llo") - 3  # inside the second event's JSON
    cut2 = body.index(b"\n\n", cut1) + 1  # between the two newlines that end it
    cut3 = body.index(b"[DONE]") + 2  # inside [DONE]
    reads = [body[:4], body[4:cut1], body[cut1:cut2], body[cut2:cut3], body[cut3:]]
    groups, resp = await read_script(reads)
    assert [[o.text for o in g] for g in groups] == [[], ["hé"], ["llo"], [], ["!"], []]
    assert sum(len(o.token_ids) for g in groups for o in g) == 3 and resp.released
    crlf = body.replace(b"\n", b"\r\n")  # servers that end lines with CRLF
    groups, _ = await read_script([crlf[:7], crlf[7:]])
    assert "".join(o.text for g in groups for o in g) == "héllo!"


@pytest.mark.asyncio
async def test_an_error_in_the_read_of_the_first_deltas_can_still_fall_back() -> None:
    error = {"error": {"message": "overloaded", "type": "rate_limit_error"}}
    with pytest.raises(QueueFull):  # the deltas before it in the same read never went out
        await read_script([sse(delta(0, "a"), delta(0, "b"), error)])
    with pytest.raises(EngineError):  # once a read's deltas went out, no fallback
        await read_script([sse(delta(0, "a")), sse(delta(0, "b"), error)])
    with pytest.raises(ServiceUnavailable):  # cut short: nothing went out yet
        await read_script([sse(delta(0, "a"), delta(0, "b"), done=True)])
    with pytest.raises(EngineError) as info:
        await read_script([sse(delta(0, "a")), b"data: {not json\n\n"])
    assert info.value.code == "upstream_error"


@pytest.mark.asyncio
async def test_a_burst_from_a_real_upstream_is_merged(fake: FakeUpstream) -> None:
    fake.burst, fake.extra_usage = True, 3
    e = await engine_for(fake.url)
    try:
        outs = await collect(e, req(max_tokens=64))
    finally:
        await e.stop()
    assert len(outs) <= 2  # 64 events in one write: one read (two if the socket split it)
    assert "".join(o.text for o in outs) == "".join(f" w{i}" for i in range(64))
    assert sum(len(o.token_ids) for o in outs) == 67 and outs[-1].finish_reason == "length"


# ---- non-streamed upstream calls --------------------------------------------
def by_choice(outs: list[EngineOutput]) -> dict[int, tuple[str, int, str | None, str | int | None, list[str]]]:
    merged: dict[int, tuple[str, int, str | None, str | int | None, list[str]]] = {}
    for o in outs:
        text, tokens, _, _, lps = merged.get(o.index, ("", 0, None, None, []))
        lps = lps + [lp.token for lp in o.logprobs or () if lp is not None]
        merged[o.index] = (text + o.text, tokens + len(o.token_ids), o.finish_reason, o.stop_reason, lps)
    return dict(sorted(merged.items()))


@pytest.mark.asyncio
@pytest.mark.parametrize(("n", "logprobs", "extra"), [(1, None, 0), (1, None, 2), (2, None, 0), (2, 1, 2)])
async def test_non_stream_call_answers_like_the_stream(
    fake: FakeUpstream, n: int, logprobs: int | None, extra: int
) -> None:
    fake.extra_usage, fake.cached = extra, 2
    e = await engine_for(fake.url)
    try:
        streamed = await collect(e, req("s", max_tokens=5, n=n, logprobs=logprobs))
        whole = await collect(e, replace(req("w", max_tokens=5, n=n, logprobs=logprobs), stream=False))
    finally:
        await e.stop()
    assert fake.bodies[0]["stream"] is True and "stream_options" in fake.bodies[0]
    assert fake.bodies[1]["stream"] is False and "stream_options" not in fake.bodies[1]
    assert len(whole) == n and [o.index for o in whole] == list(range(n)) and all(o.finished for o in whole)
    s, w = by_choice(streamed), by_choice(whole)
    assert [(v[0], v[2], v[3], v[4]) for v in w.values()] == [(v[0], v[2], v[3], v[4]) for v in s.values()]
    assert w[0][2] == "length" and (n == 1 or w[1][2] == "stop")
    total = 5 + (4 if n == 2 else 0) + extra
    assert sum(v[1] for v in w.values()) == sum(v[1] for v in s.values()) == total
    # per choice: logprobs counts or max_tokens for the length-cut choice, the rest of the usage to the last
    assert [v[1] for v in w.values()] == [5 + (extra if n == 1 else 0), 4 + extra][:n]
    assert sum(o.cached_tokens for o in whole) == sum(o.cached_tokens for o in streamed) == 2
    assert {o.prompt_tokens for o in whole} == {3}


def test_split_tokens_shares_the_usage_total() -> None:
    assert split_tokens(9, ["a b c d e", "x y z w"], [None, None], ["length", "stop"], 5) == [5, 4]
    assert split_tokens(12, ["a", "b"], [3, 7], ["stop", "stop"], 50) == [3, 9]  # logprobs counts, total exact
    assert split_tokens(10, ["aaaa", "aaaa", "aaaa"], [None] * 3, ["stop"] * 3, 50) == [4, 3, 3]
    assert split_tokens(7, ["long text here", "x"], [None, None], ["length", "length"], 3) == [3, 4]
    assert split_tokens(5, ["long text here", "x"], [None, None], ["length", "length"], 3) == [4, 1]
    assert split_tokens(0, [""], [None], ["stop"], 5) == [0]
    for total in range(0, 40):
        counts = split_tokens(total, ["ab", "", "abcdef"], [None, 2, None], ["stop", "length", "stop"], 9)
        assert sum(counts) == max(total, 2) and min(counts) >= 0


@pytest.mark.asyncio
async def test_non_stream_error_statuses_map_like_the_stream(fake: FakeUpstream) -> None:
    e = await engine_for(fake.url, eject_after=10)
    try:
        for status, kind in ((500, ServiceUnavailable), (503, ServiceUnavailable), (429, QueueFull),
                             (400, InvalidRequest)):
            fake.status = status
            with pytest.raises(kind) as info:
                await collect(e, replace(req(), stream=False))
            assert "boom" in info.value.message
        assert e.upstream.endpoints[0].failures == 2  # the 5xx count against the upstream
        fake.status = 200
        assert len(await collect(e, replace(req(), stream=False))) == 1
        assert e.upstream.endpoints[0].failures == 0
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_non_stream_waits_for_long_answers_until_the_deadline(fake: FakeUpstream) -> None:
    fake.delay = 0.1  # the answer takes 0.4 s, longer than read_timeout: silence is normal here
    hole = await RawServer("blackhole").start()
    e = await engine_for(fake.url, read_timeout=0.2)
    bad = await engine_for(hole.url, read_timeout=0.2, eject_after=2)
    try:
        outs = await collect(e, replace(req(max_tokens=4), stream=False, deadline=time.monotonic() + 5))
        assert outs[0].text == " w0 w1 w2 w3" and len(outs[0].token_ids) == 4
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable) as info:
            await collect(bad, replace(req(), stream=False, deadline=t0 + 0.6))
        assert info.value.code == "upstream_timeout" and 0.5 < time.monotonic() - t0 < 2.0
        assert (bad.upstream.endpoints[0].failures, bad.upstream.endpoints[0].last_error) == (1, "timeout")
    finally:
        await e.stop()
        await bad.stop()
        await hole.stop()


@pytest.mark.asyncio
async def test_non_stream_retries_an_unreachable_url_on_the_other(fake: FakeUpstream) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    e = await engine_for(dead, fake.url, connect_timeout=0.5)
    try:
        for i in range(3):
            outs = await collect(e, replace(req(f"r{i}", max_tokens=2), stream=False))
            assert [o.text for o in outs] == [" w0 w1"]
        assert e.upstream.endpoints[0].failures >= 1 and len(fake.bodies) == 3
    finally:
        await e.stop()


@pytest.mark.asyncio
async def test_non_stream_cancel_closes_the_upstream_connection(fake: FakeUpstream) -> None:
    fake.delay = 0.05
    pool = build_remote_pool(
        UpstreamConfig(name="m", urls=(fake.url,), health_interval=30), tokenizer=ByteTokenizer(),
        readiness_interval=60,
    )
    await pool.start()
    try:
        task = asyncio.ensure_future(anext(aiter(pool.generate(replace(req("long", max_tokens=100), stream=False)))))
        await asyncio.sleep(0.2)
        assert not task.done() and fake.bodies[-1]["stream"] is False and fake.disconnects == 0
        task.cancel()  # what a client disconnect does to a non-streamed request
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(40):
            if fake.disconnects:
                break
            await asyncio.sleep(0.025)
        assert fake.disconnects == 1
        assert pool.running == 0 and pool.workers[0].engine.stats().running == 0
    finally:
        await pool.stop()
