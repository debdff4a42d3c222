"""The per-request record reaches every record sink (app.state.record_sinks)
with the access log off too: one record per request, succeeded, refused,
failed or cancelled, with its finish reason."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from sim_app import running_app
from support import free_port, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from server.app import create_app
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


async def _asgi_call(app: Any, body: dict[str, Any], leave_after: float) -> list[bytes]:
    """Call the ASGI app directly with a client that disconnects after
    `leave_after` seconds; the body of each write."""
    writes: list[bytes] = []
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await asyncio.sleep(leave_after)
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            writes.append(msg.get("body", b""))

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
    }
    # a client that left is no error of the app's: nothing may reach the server
    # (uvicorn logs whatever does as "Exception in ASGI application")
    await app(scope, receive, send)
    return writes


@pytest.mark.asyncio
async def test_sinks_get_one_record_per_request_with_the_access_log_off() -> None:
    records: list[dict[str, Any]] = []
    settings = Settings(access_log_format="off", api_key=["sk-a"])
    auth = {"Authorization": "Bearer sk-a"}
    async with running_app(settings, sim=SimulatedConfig(max_model_len=256, ttft=0.01)) as (client, app):
        app.state.record_sinks.append(records.append)
        r = await client.post("/v1/chat/completions", json=CHAT, headers={**auth, "X-Request-ID": "r-plain"})
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth)
        assert r.status_code == 200 and "[DONE]" in r.text
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=auth)
        assert r.status_code == 400
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        await wait_until(lambda: len(records) == 4, what="4 records")
    plain, streamed, bad, unauth = records
    assert plain["request_id"] == "r-plain" and plain["key"] == "key-1" and plain["model"] == "sim"
    assert plain["status"] == 200 and plain["finish_reason"] == "length" and plain["completion_tokens"] == 3
    assert plain["upstream"] is None and plain["target"] == "sim" and plain["duration"] >= plain["ttft"] > 0
    assert streamed["status"] == 200 and streamed["finish_reason"] == "length"
    assert bad["status"] == 400 and bad["finish_reason"] is None and bad["completion_tokens"] is None
    assert unauth["status"] == 401 and unauth["key"] is None


@pytest.mark.asyncio
async def test_cancelled_requests_have_a_record() -> None:
    records: list[dict[str, Any]] = []
    slow = SimulatedConfig(max_model_len=1024, ttft=0.02, itl=0.01)
    async with running_app(Settings(access_log_format="off"), sim=slow) as (_client, app):
        app.state.record_sinks.append(records.append)
        # mid-stream: the status line went out, then the client left
        writes = await _asgi_call(app, {**CHAT, "max_tokens": 500, "stream": True}, leave_after=0.2)
        assert any(b"data:" in w for w in writes)
        await wait_until(lambda: len(records) == 1, what="the mid-stream record")
        # before the first token of a stream, and during a non-streamed answer
        await _asgi_call(app, {**CHAT, "max_tokens": 500, "stream": True}, leave_after=0.0)
        await wait_until(lambda: len(records) == 2, what="the early-stream record")
        await _asgi_call(app, {**CHAT, "max_tokens": 500}, leave_after=0.1)
        await wait_until(lambda: len(records) == 3, what="the non-streamed record")
    mid, early, plain = records
    assert mid["status"] == 200 and mid["finish_reason"] == "cancelled" and 0 < mid["completion_tokens"] < 500
    assert early["status"] == 499 and early["finish_reason"] == "cancelled"
    assert plain["status"] == 499 and plain["finish_reason"] == "cancelled"


@pytest.mark.asyncio
async def test_a_failing_sink_fails_nothing() -> None:
    seen: list[dict[str, Any]] = []

    def broken(rec: dict[str, Any]) -> None:
        raise RuntimeError("sink broke")

    async with running_app(Settings(access_log_format="off")) as (client, app):
        app.state.record_sinks.extend([broken, seen.append])
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        await wait_until(lambda: len(seen) == 1, what="the second sink's record")


@asynccontextmanager
async def _live(app: Any) -> AsyncIterator[str]:
    """`app` on a real uvicorn server on 127.0.0.1; its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_until(lambda: server.started or task.done(), timeout=120, what="uvicorn to start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.mark.asyncio
async def test_a_passed_through_request_names_its_node() -> None:
    node_pool = WorkerPool("sim", lambda i: SimulatedEngine(SimulatedConfig(max_model_len=256)))
    node_app = create_app(Settings(access_log_format="off"), pools=[(node_pool, ("sim",), "sim")])
    async with _live(node_app) as node_url:
        tier = Settings(model="none", upstream=[f"remote={node_url}"], readiness_interval=1, access_log_format="off")
        tier_app = create_app(tier)
        records: list[dict[str, Any]] = []
        tier_app.state.record_sinks.append(records.append)
        async with _live(tier_app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json={**CHAT, "model": "remote", "stream": stream})
                assert r.status_code == 200, r.text
            await wait_until(lambda: len(records) == 2, what="2 records")
    for rec in records:
        assert rec["upstream"] == node_url and rec["target"] == "remote" and rec["model"] == "remote"
        assert rec["completion_tokens"] == 3 and rec["status"] == 200
