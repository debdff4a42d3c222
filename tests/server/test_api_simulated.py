"""Protocol validation, error mapping, SSE framing, auth and limits through
the real ASGI app on simulated engines."""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import struct
from pathlib import Path

import httpx
import orjson
import pytest
from sim_app import running_app
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err  # type: ignore[no-any-return]


@pytest.mark.asyncio
async def test_chat_non_stream_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=CHAT)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "The quick brown"
    assert body["usage"]["completion_tokens"] == 3
    assert r.headers["x-request-id"]


@pytest.mark.asyncio
async def test_request_id_is_echoed(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


@pytest.mark.asyncio
async def test_sse_framing_and_usage(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-accel-buffering"] == "no"
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.asyncio
async def test_aliases_and_models_list(client: httpx.AsyncClient) -> None:
    data = (await client.get("/v1/models")).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["sim-alias"]["parent"] == "sim" and by_id["sim"]["parent"] is None
    assert by_id["sim"]["max_model_len"] == 256
    assert by_id["sim"]["slots"] == 64  # one worker with 64 slots: what a tier in front reads
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "sim-alias"})
    assert r.json()["model"] == "sim-alias"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "n": 99}, "n"),
        ({**CHAT, "max_tokens": -5}, "max_tokens"),
        ({**CHAT, "max_tokens": 300}, "max_tokens"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0]"),
        ({**CHAT, "top_logprobs": 3}, None),
        ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": CHAT["messages"]}, "model"),
    ],
)
async def test_bad_input_400_with_param(client: httpx.AsyncClient, body: dict[str, object], param: str | None) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    err = assert_openai_error(r, 400)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.asyncio
async def test_nan_and_invalid_json_and_utf8(client: httpx.AsyncClient) -> None:
    h = {"content-type": "application/json"}
    r = await client.post("/v1/chat/completions", content=b'{"model":"sim","messages":[{"role":"user","content":"x"}],"temperature":NaN}', headers=h)
    assert_openai_error(r, 400)
    r = await client.post("/v1/chat/completions", content=b"{not json", headers=h)
    assert assert_openai_error(r, 400)["code"] == "invalid_json"
    r = await client.post("/v1/chat/completions")  # no body at all: said so, no 'parameter: None'
    assert assert_openai_error(r, 400)["message"] == "the request has no JSON body"
    r = await client.post("/v1/chat/completions", content=b'{"model":"sim","messages":[{"role":"user","content":"\xff\xfe"}]}', headers=h)
    assert_openai_error(r, 400)


@pytest.mark.asyncio
async def test_wrong_content_type_and_body_limit() -> None:
    async with running_app(Settings(max_request_body_bytes=2048)) as (c, _):
        r = await c.post("/v1/chat/completions", content=b"model=sim", headers={"content-type": "text/plain"})
        assert_openai_error(r, 415)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await c.post("/v1/chat/completions", json=big)
        assert assert_openai_error(r, 413)["code"] == "request_too_large"


@pytest.mark.asyncio
async def test_unknown_fields_ignored_unknown_model_404_unknown_route(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "some_future_field": {"x": 1}})
    assert r.status_code == 200
    err = assert_openai_error(await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_openai_error(await client.get("/v1/nothing-here"), 404)


@pytest.mark.asyncio
async def test_wrong_model_kind(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.post("/v1/chat/completions", json={**CHAT, "model": "emb"}), 400, "model")
    assert_openai_error(await client.post("/v1/embeddings", json={"model": "sim", "input": "x"}), 400, "model")


@pytest.mark.asyncio
async def test_embeddings_float_base64_and_dimensions(client: httpx.AsyncClient) -> None:
    r = (await client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})).json()
    assert [d["index"] for d in r["data"]] == [0, 1] and len(r["data"][0]["embedding"]) == 8
    b = (await client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"], "encoding_format": "base64"})).json()
    raw = base64.b64decode(b["data"][0]["embedding"])
    assert list(struct.unpack("<8f", raw)) == pytest.approx(r["data"][0]["embedding"], rel=1e-6)
    r2 = await client.post("/v1/embeddings", json={"model": "emb", "input": "a", "dimensions": 4})
    assert_openai_error(r2, 400, "dimensions")


@pytest.mark.asyncio
async def test_tokenize_detokenize_roundtrip(client: httpx.AsyncClient) -> None:
    t = (await client.post("/tokenize", json={"model": "sim", "prompt": "héllo", "add_special_tokens": False})).json()
    assert t["count"] == len("héllo".encode()) and t["max_model_len"] == 256
    d = (await client.post("/detokenize", json={"model": "sim", "tokens": t["tokens"]})).json()
    assert d["prompt"] == "héllo"
    assert (await client.get("/version")).json()["version"]


@pytest.mark.asyncio
async def test_api_keys_headers_and_401(tmp_path: Path) -> None:
    async with running_app(Settings(api_key=["sk-one"])) as (c, _):
        assert_openai_error(await c.post("/v1/chat/completions", json=CHAT), 401)
        assert_openai_error(await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer bad"}), 401)
        for h in ({"Authorization": "Bearer sk-one"}, {"api-key": "sk-one"}, {"x-api-key": "sk-one"}):
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=h)).status_code == 200
        assert_openai_error(await c.get("/v1/models"), 401)
        assert_openai_error(await c.post("/tokenize", json={"prompt": "x"}), 401)
        assert_openai_error(await c.post("/start_profile"), 401)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


def _keys_file(tmp_path: Path, **limits: object) -> Path:
    entry = {"name": "team-a", "sha256": hashlib.sha256(b"sk-team-a").hexdigest(), **limits}
    p = tmp_path / "keys.yaml"
    import yaml

    p.write_text(yaml.safe_dump({"keys": [entry]}))
    return p


@pytest.mark.asyncio
async def test_keys_file_model_allow_list(tmp_path: Path) -> None:
    s = Settings(api_keys_file=_keys_file(tmp_path, models=["sim"]))
    h = {"Authorization": "Bearer sk-team-a"}
    async with running_app(s) as (c, _):
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=h)).status_code == 200
        assert_openai_error(await c.post("/v1/chat/completions", json={**CHAT, "model": "sim-alias"}, headers=h), 403)
        assert_openai_error(await c.post("/v1/chat/completions", json={**CHAT, "model": "zzz"}, headers=h), 404)


@pytest.mark.asyncio
async def test_requests_per_minute_limit_and_headers(tmp_path: Path) -> None:
    s = Settings(api_keys_file=_keys_file(tmp_path, requests_per_minute=2, tokens_per_minute=10_000))
    h = {"Authorization": "Bearer sk-team-a"}
    async with running_app(s) as (c, _app):
        r1 = await c.post("/v1/chat/completions", json=CHAT, headers=h)
        assert r1.headers["x-ratelimit-limit-requests"] == "2"
        assert r1.headers["x-ratelimit-remaining-requests"] == "1"
        assert r1.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(r1.headers["x-ratelimit-remaining-tokens"]) < 10_000
        assert "x-ratelimit-reset-requests" in r1.headers and "x-ratelimit-reset-tokens" in r1.headers
        await c.post("/v1/chat/completions", json=CHAT, headers=h)
        r3 = await c.post("/v1/chat/completions", json=CHAT, headers=h)
        assert_openai_error(r3, 429)
        assert int(r3.headers["retry-after"]) >= 1
        assert r3.headers["x-ratelimit-remaining-requests"] == "0"
        metrics = (await c.get("/metrics")).text
        assert 'npugw_api_key_requests_total{api_key_name="team-a",model_name="sim"} 2.0' in metrics
        assert "sk-team-a" not in metrics


@pytest.mark.asyncio
async def test_tokens_per_minute_and_concurrency_limits(tmp_path: Path) -> None:
    s = Settings(api_keys_file=_keys_file(tmp_path, tokens_per_minute=100))
    h = {"Authorization": "Bearer sk-team-a"}
    async with running_app(s) as (c, _):
        err = assert_openai_error(await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200}, headers=h), 429)
        assert "tokens per minute" in str(err["message"])
    s = Settings(api_keys_file=_keys_file(tmp_path, max_concurrent=1))
    async with running_app(s, sim=SimulatedConfig(itl=0.05, max_model_len=256)) as (c, app):
        slow = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10}, headers=h))
        await wait_until(lambda: app.state.gateway.pools[0].running == 1)
        assert_openai_error(await c.post("/v1/chat/completions", json=CHAT, headers=h), 429)
        assert (await slow).status_code == 200


@pytest.mark.asyncio
async def test_key_default_priority_is_used(tmp_path: Path) -> None:
    s = Settings(api_keys_file=_keys_file(tmp_path, priority=-5))
    async with running_app(s) as (c, app):
        gw = app.state.gateway
        seen: list[int] = []
        engine = gw.pools[0].workers[0].engine
        original = engine.generate

        def spy(req):  # type: ignore[no-untyped-def]
            seen.append(req.priority)
            return original(req)

        engine.generate = spy
        h = {"Authorization": "Bearer sk-team-a"}
        await c.post("/v1/chat/completions", json=CHAT, headers=h)
        await c.post("/v1/chat/completions", json={**CHAT, "priority": 3}, headers=h)
        assert seen == [-5, 3]


@pytest.mark.asyncio
async def test_queue_full_429_and_timeout_503_over_http() -> None:
    sim = SimulatedConfig(itl=0.05, max_model_len=256)
    async with running_app(sim=sim, slots=1, max_queue_size=1, max_queue_wait=0.3) as (c, app):
        pool = app.state.gateway.pools[0]
        slow = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20}))
        await wait_until(lambda: pool.running == 1)
        waiting = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await wait_until(lambda: pool.queue_depth == 1)
        full = await c.post("/v1/chat/completions", json=CHAT)
        assert assert_openai_error(full, 429)["code"] == "queue_full"
        assert full.headers["retry-after"] == "1"
        timed_out = await waiting
        assert assert_openai_error(timed_out, 503)["code"] == "queue_timeout"
        assert (await slow).status_code == 200
        text = (await c.get("/metrics")).text
        assert 'npugw_admission_rejections_total{model_name="sim",reason="queue_full"} 1.0' in text
        assert 'npugw_admission_rejections_total{model_name="sim",reason="queue_timeout"} 1.0' in text


@pytest.mark.asyncio
async def test_request_timeout_in_stream_gives_error_event_then_done() -> None:
    sim = SimulatedConfig(itl=0.05, max_model_len=256)
    async with running_app(Settings(request_timeout=0.2), sim=sim) as (c, _):
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        err = orjson.loads(events[-2][6:])["error"]
        assert err["code"] == "request_timeout"
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert_openai_error(r, 504)
        assert c.engines[0].stats().unfinished == 0  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_keep_alive_comments_on_a_quiet_stream() -> None:
    """Once the stream has begun (its status line waits for the first token),
    a quiet gap gets keep-alive comments."""
    sim = SimulatedConfig(itl=0.5, max_model_len=256)
    async with running_app(Settings(sse_keep_alive_interval=0.1), sim=sim) as (c, _):
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True})
        first_token = r.text.index('"content":"The"')
        assert r.text.count(": keep-alive\n\n", first_token) >= 3
        assert r.text.endswith("data: [DONE]\n\n")


@pytest.mark.asyncio
async def test_ready_reflects_draining(client: httpx.AsyncClient) -> None:
    assert (await client.get("/ready")).status_code == 200
    transport = client._transport
    app = transport.app  # type: ignore[attr-defined]
    app.state.gateway.begin_drain()
    r = await client.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "draining"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert assert_openai_error(r, 503)["code"] == "shutting_down"
    assert r.headers["retry-after"]


@pytest.mark.asyncio
async def test_admin_key_alone_guards_only_admin_routes() -> None:
    async with running_app(Settings(admin_api_key="sk-admin")) as (c, _):
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert_openai_error(await c.post("/start_profile"), 401)
        assert_openai_error(await c.post("/start_profile", headers={"Authorization": "Bearer nope"}), 401)
        # authorised, but simulated engines have no profiler: a clear 400
        assert_openai_error(await c.post("/start_profile", headers={"Authorization": "Bearer sk-admin"}), 400)
    async with running_app(Settings(api_key=["sk-user"], admin_api_key="sk-admin")) as (c, _):
        r = await c.post("/start_profile", headers={"Authorization": "Bearer sk-user"})
        assert_openai_error(r, 403)


@pytest.mark.asyncio
async def test_several_models_each_with_its_own_pool() -> None:
    from prometheus_client import CollectorRegistry

    from engine_adapter.metrics import EngineMetrics
    from server.app import create_app
    from server.models_setup import build_served_pools

    s = Settings(backend="simulated", served_model_name=["a"], extra_model=["b,b2=/models/b"], embedding_model="none")
    pools = build_served_pools(s, EngineMetrics(CollectorRegistry()))
    assert [names for _, names, _ in pools] == [("a",), ("b", "b2")]
    app = create_app(s, pools=pools)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert models["b2"]["parent"] == "b" and models["b"]["root"] == "/models/b"
            for name in ("a", "b", "b2"):
                r = await c.post("/v1/chat/completions", json={**CHAT, "model": name})
                assert r.status_code == 200 and r.json()["model"] == name
            gw = app.state.gateway
            assert gw.models["a"].pool is not gw.models["b"].pool
            assert gw.models["b"].pool is gw.models["b2"].pool


@pytest.mark.asyncio
async def test_metrics_key_and_long_prompt(client: httpx.AsyncClient) -> None:
    long_prompt = {**CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 400}]}
    err = assert_openai_error(await client.post("/v1/chat/completions", json=long_prompt), 400)
    assert err["code"] == "context_length_exceeded" and "256" in str(err["message"])
    async with running_app(Settings(metrics_api_key="sk-metrics", api_key=["sk-user"])) as (c, _):
        assert_openai_error(await c.get("/metrics"), 401)
        assert_openai_error(await c.get("/metrics", headers={"Authorization": "Bearer sk-user"}), 401)
        ok = await c.get("/metrics", headers={"Authorization": "Bearer sk-metrics"})
        assert ok.status_code == 200 and "npugw_http_requests_total" in ok.text
        assert (await c.get("/health")).status_code == 200 and (await c.get("/ready")).status_code == 200


async def _asgi_stream(
    app: object, body: dict[str, object], write_delay: float = 0.0, leave_after: float | None = None
) -> list[bytes]:
    """Call the ASGI app directly with a client whose socket writes take
    `write_delay` s (and who disconnects after `leave_after` s); return the
    body of each write."""
    writes: list[bytes] = []
    sent = False
    done = asyncio.Event()

    async def receive() -> dict[str, object]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        if leave_after is not None:
            await asyncio.sleep(leave_after)
        else:
            await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, object]) -> None:
        if msg["type"] == "http.response.body":
            await asyncio.sleep(write_delay)
            writes.append(msg.get("body", b""))  # type: ignore[arg-type]

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
    }
    try:
        await app(scope, receive, send)  # type: ignore[operator]
    finally:
        done.set()
    return writes


@pytest.mark.asyncio
async def test_slow_client_gets_several_chunks_per_write_and_the_same_text() -> None:
    sim = SimulatedConfig(itl=0.005, max_model_len=256)
    body = {**CHAT, "max_tokens": 40, "stream": True}
    async with running_app(sim=sim) as (c, app):
        plain = (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40})).json()
        writes = await _asgi_stream(app, body, write_delay=0.03)
    events = [e for w in writes for e in w.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({ch["id"] for ch in chunks}) == 1
    assert len(writes) < len(events) - 10  # tokens that piled up went out together
    assert all(w.endswith(b"\n\n") or not w for w in writes)  # never an event cut across writes


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_aborts_the_engine_request() -> None:
    sim = SimulatedConfig(itl=0.01, max_model_len=1024)
    async with running_app(sim=sim) as (c, _app):
        body = {**CHAT, "max_tokens": 500, "stream": True}
        writes = await asyncio.wait_for(_asgi_stream(_app, body, leave_after=0.1), 2.0)
        engine = c.engines[0]  # type: ignore[attr-defined]
        assert 3 < len(writes) < 100  # some tokens went out, then the stream stopped
        assert not any(b"[DONE]" in w for w in writes)
        assert len(engine.aborted) == 1 and engine.stats().unfinished == 0
        pool = _app.state.gateway.pools[0]
        assert pool.running == 0 and pool.workers[0].in_flight == 0


@pytest.mark.asyncio
async def test_startup_heap_is_frozen_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NPUGW_GC_FREEZE")  # the production default (conftest sets it to 0)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    async with running_app() as (c, _):
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the collector no longer walks the startup heap
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
