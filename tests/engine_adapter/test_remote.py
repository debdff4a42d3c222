"""The gateway tier: a gateway-only app (`--model none`) in front of
recording upstream nodes (small OpenAI-shaped servers, vLLM's wire format),
on a real uvicorn socket. What arrives upstream (path, the body unchanged
but for `model`, vendor fields, tools, stream_options, the request id), what
the client gets (tool calls, text, usage, `model` as the client named it),
model ids learned from the node, and bounded failures: 4xx relayed, 429 with
its Retry-After, 5xx, a node that closes mid-stream, a black hole, a URL
ejected while requests wait on it, a client that disconnects."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
from fakes import FakeNode, tier
from sim_app import serve
from support import metric_value, wait_until

from engine_adapter.backends.aggregate import aggregate
from server.middleware import ACCESS_LOGGER
from server.settings import Settings

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}}}}]


@pytest_asyncio.fixture
async def node() -> AsyncIterator[FakeNode]:
    n = await FakeNode().start()
    yield n
    await n.stop()


def events(raw: bytes) -> list[Any]:
    parts = [e for e in raw.decode().split("\n\n") if e and not e.startswith(":")]
    assert parts[-1] == "data: [DONE]", raw[-300:]
    return [orjson.loads(p[6:]) for p in parts[:-1]]


@pytest.mark.asyncio
async def test_a_chat_stream_passes_through_with_only_model_changed(node: FakeNode) -> None:
    async with serve(None, tier(f"remote={node.url}")) as (client, _):
        body = {"model": "remote", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": TOOLS, "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False},
                "top_k": 5, "min_p": 0.1, "guided_json": {"type": "object"}, "priority": 3, "stream": True,
                "max_tokens": 30, "some_vendor_field": [1, 2]}
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"X-Request-ID": "rid-42"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = await r.aread()
        path, got, headers = node.calls[-1]
        assert path == "/v1/chat/completions" and headers["x-request-id"] == "rid-42", headers
        assert got == {**body, "model": "node-model", "stream_options": {"include_usage": True}}
        chunks = events(raw)
        assert {c["model"] for c in chunks} == {"remote"}
        assert all(c["choices"] for c in chunks)  # the usage chunk the client did not ask for is kept back
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "The capital is Paris."
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
        assert calls[0]["id"] == "call-1" and "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
        metrics = (await client.get("/metrics")).text
        assert metric_value(metrics, "npugw_api_key_tokens_total", model_name="remote", type="prompt") == 11
        assert metric_value(metrics, "npugw_api_key_tokens_total", model_name="remote", type="completion") == 6


@pytest.mark.asyncio
@pytest.mark.parametrize("plain", ["direct", "stream"])
async def test_usage_reaches_the_client_only_when_asked_and_a_plain_call_is_relayed_or_joined(
    node: FakeNode, plain: str
) -> None:
    spec = f"remote={node.url}" + (";plain=stream" if plain == "stream" else "")
    async with serve(None, tier(spec)) as (client, _):
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.post("/v1/chat/completions", json={"model": "remote", "messages": msgs, "stream": True,
                                                            "stream_options": {"include_usage": True}})
        chunks = events(r.content)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        assert chunks[-1]["model"] == "remote"
        body = {"model": "remote", "messages": msgs, "tools": TOOLS, "top_k": 3}
        r = await client.post("/v1/chat/completions", json=body)
        answer = r.json()
        assert r.status_code == 200 and answer["object"] == "chat.completion" and answer["model"] == "remote"
        msg = answer["choices"][0]["message"]
        assert msg["content"] == "The capital is Paris." and msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
        sent = node.calls[-1][1]
        if plain == "stream":  # served from a streamed call joined back
            assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        else:  # the same body, only model changed
            assert sent == {**body, "model": "node-model"}
        r = await client.post("/v1/completions", json={"model": "remote", "prompt": "The capital", "echo": False})
        assert r.json()["choices"][0]["text"] == "The capital is Paris." and r.json()["model"] == "remote"
        assert node.calls[-1][0] == "/v1/completions"
        metrics = (await client.get("/metrics")).text
        assert metric_value(metrics, "npugw_api_key_tokens_total", model_name="remote", type="completion") == 18


@pytest.mark.asyncio
async def test_the_node_model_id_is_learned_or_picked_and_a_mismatch_is_named() -> None:
    two = await FakeNode(models=("a", "b")).start()
    try:
        async with serve(None, tier(f"many={two.url}", f"picked={two.url};model=b", f"wrong={two.url};model=z",
                                    admin_api_key="adm")) as (client, _):
            routes = (await client.get("/admin/routes", headers={"Authorization": "Bearer adm"})).json()
            ups = {u["upstream"]: u for u in routes["upstreams"]}
            assert "serves several models (a, b): pick one with ;model=ID" in ups["many"]["urls"][0]["last_error"]
            assert "does not serve 'z' (it serves a, b)" in ups["wrong"]["urls"][0]["last_error"]
            assert ups["picked"]["urls"][0]["model"] == "b" and ups["picked"]["urls"][0]["last_error"] is None
            msgs = [{"role": "user", "content": "hi"}]
            r = await client.post("/v1/chat/completions", json={"model": "picked", "messages": msgs})
            assert r.status_code == 200 and two.calls[-1][1]["model"] == "b" and r.json()["model"] == "picked"
            r = await client.post("/v1/chat/completions", json={"model": "many", "messages": msgs})
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_ejected"
    finally:
        await two.stop()


@pytest.mark.asyncio
async def test_node_errors_keep_their_status(node: FakeNode) -> None:
    async with serve(None, tier(f"remote={node.url}")) as (client, _):
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        node.status = 400
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"] == "node says 400"  # the node's own body
        node.status, node.retry_after = 429, "7"
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["type"] == "rate_limit_error"
        node.status, node.retry_after = 500, None
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_error"
        assert not r.content.startswith(b"data:")


@pytest.mark.asyncio
async def test_a_node_that_closes_mid_stream_ends_with_an_error_event(node: FakeNode) -> None:
    node.cut, node.delay = True, 0.05  # the first chunks reach the client, then the node closes
    async with serve(None, tier(f"remote={node.url}")) as (client, app):
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        chunks = events(r.content)
        assert chunks[-1]["error"]["code"] == "upstream_disconnected" and len(chunks) >= 2
        pool = app.state.gateway.pools[0]
        await wait_until(lambda: pool.running == 0 and pool.workers[0].in_flight == 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_black_hole_ends_within_read_timeout_while_a_healthy_node_answers(node: FakeNode, stream: bool) -> None:
    hole = await FakeNode().start()
    try:
        slow = f"hole={hole.url};read_timeout=1;health_interval=30"
        async with serve(None, tier(slow, f"ok={node.url}")) as (client, _):
            hole.hang = True  # after the start-up checks: it accepts and never answers
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            t0 = time.monotonic()
            held = asyncio.ensure_future(client.post("/v1/chat/completions", json={**body, "model": "hole"}))
            for _ in range(3):  # the healthy node keeps answering meanwhile
                ok = await client.post("/v1/chat/completions", json={**body, "model": "ok"})
                assert ok.status_code == 200
            r = await held
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_timeout"
            assert time.monotonic() - t0 < 1 + 2
    finally:
        await hole.stop()


@pytest.mark.asyncio
async def test_an_ejected_url_fails_the_requests_waiting_on_it_at_once(node: FakeNode) -> None:
    cfg = f"remote={node.url};read_timeout=60;health_interval=0.2;eject_after=1"
    async with serve(None, tier(cfg)) as (client, _):
        node.hang = True
        t0 = time.monotonic()
        r = await client.post("/v1/chat/completions", json={"model": "remote",
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_ejected"
        assert time.monotonic() - t0 < 10  # the health checks, not the 60 s read timeout


@pytest.mark.asyncio
async def test_a_url_whose_breaker_opened_serves_again_after_its_cooldown(node: FakeNode) -> None:
    """The breaker's half-open trial reaches the node and closes it again;
    then requests are shared by both URLs with no failed first attempt (a
    breaker that opened once used to fail every later attempt on its URL at
    once, each request paying a retry on the other URL)."""
    bad = await FakeNode().start()
    try:
        cfg = f"remote={bad.url},{node.url};eject_after=2;cooldown=0.3;health_interval=30"
        async with serve(None, tier(cfg)) as (client, app):
            up = app.state.gateway.pools[0].workers[0].engine.upstream
            body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            bad.status = 500  # each attempt on it fails and is retried on the other URL
            while up.endpoints[0].state != "open":
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert len(bad.calls) <= 2
            bad.status = 200
            served = len(bad.calls)
            ep = up.endpoints[0]
            await wait_until(lambda: ep.state_at(time.monotonic(), up.cfg.cooldown) == "half_open",
                             what="the breaker's cooldown")
            for _ in range(2):  # the trial goes to it now, or after one request on the other URL (round robin)
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                if ep.state == "closed":
                    break
            assert ep.state == "closed", up.describe()
            assert len(bad.calls) == served + 1  # the trial, answered by the node
            decisions = up.policy.stats.decisions["least_outstanding"]
            before = (len(bad.calls), len(node.calls))
            for _ in range(6):
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert events(r.content)[-1]["choices"][0]["finish_reason"] == "stop"
            assert (len(bad.calls) - before[0], len(node.calls) - before[1]) == (3, 3)
            assert up.policy.stats.decisions["least_outstanding"] - decisions == 6  # no attempt failed
    finally:
        await bad.stop()


@pytest.mark.asyncio
async def test_a_client_disconnect_closes_the_upstream_request(node: FakeNode) -> None:
    node.delay = 0.2
    async with serve(None, tier(f"remote={node.url}")) as (client, app):
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                break  # leave after the first chunk
        await wait_until(lambda: node.disconnects == 1, what="the node to see the disconnect")
        pool = app.state.gateway.pools[0]
        await wait_until(lambda: pool.running == 0 and pool.workers[0].in_flight == 0)


@pytest.mark.asyncio
async def test_gateway_only_readiness_follows_the_nodes(node: FakeNode) -> None:
    async with serve(None, tier(f"remote={node.url};health_interval=0.2;eject_after=1")) as (client, _):
        assert (await client.get("/ready")).status_code == 200
        node.hang = True
        async def not_ready() -> bool:
            return (await client.get("/ready")).status_code == 503
        await wait_until(not_ready, timeout=10, what="/ready to turn 503", interval=0.05)
        r = await client.post("/v1/embeddings", json={"model": "remote", "input": "x"})
        assert r.status_code == 503


@pytest.mark.asyncio
async def test_embeddings_pass_through(node: FakeNode) -> None:
    async with serve(None, tier(f"remote={node.url}")) as (client, _):
        r = await client.post("/v1/embeddings", json={"model": "remote", "input": "abc", "dimensions": 2})
        assert r.status_code == 200 and r.json()["model"] == "remote" and r.json()["data"][0]["embedding"]
        path, got, _ = node.calls[-1]
        assert path == "/v1/embeddings" and got == {"model": "node-model", "input": "abc", "dimensions": 2}


@pytest.mark.asyncio
async def test_the_short_path_takes_well_typed_bodies_and_the_full_path_the_rest(node: FakeNode) -> None:
    """server/fast_relay.py: a body whose own fields (stream, n, priority,
    token limits, user) are malformed goes the full path and gets the
    gateway's validation error, never reaching the node; a well-typed body is
    passed through and its other fields are the node's to judge (its 400 is
    relayed). Either way the route's metrics and access-log fields are kept."""
    async with serve(None, tier(f"remote={node.url}", access_log_format="json")) as (client, _):
        msgs = [{"role": "user", "content": "hi"}]
        for bad in ({"stream": "maybe"}, {"n": 0}, {"priority": 1.5}, {"priority": None}, {"n": None},
                    {"max_tokens": -1}, {"user": 7},
                    {"stream": True, "stream_options": {"include_usage": "perhaps"}}):
            r = await client.post("/v1/chat/completions", json={"model": "remote", "messages": msgs, **bad})
            assert r.status_code in (400, 422) and r.json()["error"]["type"] == "invalid_request_error", bad
        assert node.calls == []
        node.status = 400  # a field only the node checks
        r = await client.post("/v1/chat/completions", json={"model": "remote", "messages": msgs, "temperature": 9})
        assert r.status_code == 400 and r.json()["error"]["message"] == "node says 400"
        assert node.calls[-1][1]["temperature"] == 9
        node.status = 200
        r = await client.post("/v1/completions", content=orjson.dumps({"model": "remote", "prompt": "x" * 200_000}),
                              headers={"Content-Type": "application/json"})  # a body of several reads
        assert r.status_code == 200 and len(node.calls[-1][1]["prompt"]) == 200_000
        r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": msgs})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = await client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 422)
        metrics = (await client.get("/metrics")).text
        ok = metric_value(metrics, "npugw_http_requests_total", route="/v1/chat/completions", status="400")
        assert ok >= 1  # the node's 400, counted under the route as on the full path
        assert metric_value(metrics, "npugw_http_requests_total", route="/v1/completions", status="200") == 1


@pytest.mark.asyncio
async def test_a_client_that_leaves_before_the_first_byte_is_logged_499_and_aborts_the_node(
    node: FakeNode, caplog: pytest.LogCaptureFixture
) -> None:
    watched = [logging.getLogger(name) for name in ("uvicorn.error", ACCESS_LOGGER)]  # they do not propagate
    try:
        async with serve(None, tier(f"remote={node.url};health_interval=30", access_log_format="json")) as (
            client, app
        ):
            for lg in watched:  # once uvicorn has set up its loggers
                lg.addHandler(caplog.handler)
            node.hang = True  # after the start-up checks
            body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            held = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            await wait_until(lambda: len(node.calls) == 1, what="the request to reach the node")
            held.cancel()  # the client closes its connection
            await asyncio.gather(held, return_exceptions=True)
            pool = app.state.gateway.pools[0]
            await wait_until(lambda: pool.workers[0].in_flight == 0, what="the slot to come back")
            await wait_until(lambda: '"status":499' in caplog.text, what="the access log line")
    finally:
        for lg in watched:
            lg.removeHandler(caplog.handler)
    assert "Exception in ASGI application" not in caplog.text


def test_aggregate_joins_chat_and_text_chunks() -> None:
    head = {"id": "x", "created": 1, "model": "m", "system_fingerprint": "fp"}
    chat = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {**head, "choices": [{"index": 1, "delta": {"reasoning_content": "hmm"}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "lo"}, "logprobs": {"content": [{"t": 1}]}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "!"}, "logprobs": {"content": [{"t": 2}]},
                              "finish_reason": "stop", "stop_reason": "</s>"}]},
        {**head, "choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]
    out = aggregate("/v1/chat/completions", chat)
    assert out["object"] == "chat.completion" and out["system_fingerprint"] == "fp"
    c0, c1 = out["choices"]
    assert c0["message"]["content"] == "Hello!" and c0["logprobs"] == {"content": [{"t": 1}, {"t": 2}]}
    assert (c0["finish_reason"], c0["stop_reason"]) == ("stop", "</s>")
    assert c1["message"]["reasoning_content"] == "hmm" and c1["message"]["content"] is None
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 2}
    text = [
        {**head, "choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0],
                                                                      "top_logprobs": [None], "text_offset": [0]}}]},
        {**head, "choices": [{"index": 0, "text": "b", "finish_reason": "length",
                              "logprobs": {"tokens": ["b"], "token_logprobs": [-2.0], "top_logprobs": [None],
                                           "text_offset": [1]}}]},
    ]
    out = aggregate("/v1/completions", text)
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == "ab"
    assert out["choices"][0]["logprobs"]["tokens"] == ["a", "b"] and out["choices"][0]["finish_reason"] == "length"


def test_the_tokenizer_option_is_gone() -> None:
    with pytest.raises(ValueError, match="unknown option 'tokenizer=simulated'"):
        Settings(model="none", upstream=["remote=http://127.0.0.1:1;tokenizer=simulated"])
