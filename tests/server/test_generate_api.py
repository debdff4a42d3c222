"""/generate in vLLM's api_server shape and TGI's, and TGI's /generate_stream,
over raw HTTP on a real uvicorn socket (the `text-generation` client needs
huggingface_hub < 1, which the engine's transformers excludes; these follow
TGI's documented schemas). Also: every new route is in /openapi.json and
counted in npugw_http_requests_total."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import orjson
import pytest
from sdk_app import DEFAULT, serve_scripted
from support import metric_value, wait_until

from server.settings import Settings


def tgi_events(raw: str) -> list[dict[str, object]]:
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data:") for e in events), raw
    return [orjson.loads(e[5:]) for e in events]


@pytest.mark.asyncio
async def test_vllm_shape_whole_and_streamed(tmp_path: Path) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path)) as live, httpx.AsyncClient(base_url=live.url) as http:
        r = await http.post("/generate", json={"prompt": "Hi. ", "max_tokens": 100, "temperature": 0})
        assert r.status_code == 200 and r.json() == {"text": ["Hi. " + DEFAULT]}
        r = await http.post("/generate", json={"prompt": "Hi. ", "max_tokens": 2})
        assert r.json() == {"text": ["Hi. The quic"]}
        async with http.stream("POST", "/generate", json={"prompt": "Hi. ", "max_tokens": 100, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
        assert r.status_code == 200
        texts = [orjson.loads(line)["text"][0] for line in lines if line]
        assert texts[-1] == "Hi. " + DEFAULT and all(t.startswith("Hi. ") for t in texts)
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # the text so far, growing


@pytest.mark.asyncio
async def test_tgi_generate_and_generate_stream(tmp_path: Path) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path)) as live, httpx.AsyncClient(base_url=live.url) as http:
        r = await http.post("/generate", json={"inputs": "Hi. ", "parameters": {"max_new_tokens": 50}})
        assert r.json() == {"generated_text": DEFAULT}
        r = await http.post("/generate", json={"inputs": "Hi. ", "parameters": {
            "max_new_tokens": 3, "details": True, "return_full_text": True, "seed": 7, "top_n_tokens": 2}})
        body = r.json()
        assert body["generated_text"] == "Hi. " + DEFAULT[:12]
        d = body["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == 3 and d["seed"] == 7
        assert [t["text"] for t in d["tokens"]] == ["The ", "quic", "k br"]
        assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"} and len(d["top_tokens"][0]) == 2
        r = await http.post("/generate", json={"inputs": "x", "parameters": {"stop": ["fox"], "details": True}})
        assert r.json()["details"]["finish_reason"] == "stop_sequence"

        r = await http.post("/generate_stream", json={"inputs": "Hi. ", "parameters": {"details": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = tgi_events(r.text)
        assert [e["index"] for e in events] == list(range(1, len(events) + 1))
        assert "".join(e["token"]["text"] for e in events) == DEFAULT  # type: ignore[index]
        assert all(e["generated_text"] is None for e in events[:-1]) and events[-1]["generated_text"] == DEFAULT
        assert events[-1]["details"]["finish_reason"] == "eos_token"  # type: ignore[index]
        assert events[-1]["details"]["generated_tokens"] == len(events)  # type: ignore[index]


@pytest.mark.asyncio
async def test_errors_take_tgi_shape(tmp_path: Path) -> None:
    settings = Settings(api_key=["sk-a"], data_dir=tmp_path)
    async with serve_scripted(settings, itl=0.05, slots_per_worker=1, max_queue_size=0) as live:
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": "Bearer sk-a"}, timeout=30) as http:
            r = await http.post("/generate", json={"text": "neither"})
            assert r.status_code == 400 and r.json()["error_type"] == "validation"
            assert "prompt" in r.json()["error"] and "inputs" in r.json()["error"]
            for body in ({"inputs": "x", "parameters": {"temperature": 0}}, {"inputs": 1},
                         {"prompt": "x", "max_tokens": 0}, {"inputs": "x", "parameters": {"max_new_tokens": 99999}}):
                r = await http.post("/generate", json=body)
                assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}, (body, r.text)
            r = await http.post("/generate_stream", json={"prompt": "x"})
            assert r.status_code == 422
            r = await http.post("/generate", json={"inputs": "x"}, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and r.json()["error_type"] == "authentication"
            r = await http.post("/generate", content=b"prompt=x", headers={"content-type": "text/plain"})
            assert r.status_code == 415 and "error_type" in r.json()

            busy = asyncio.ensure_future(http.post("/generate", json={"prompt": "x", "max_tokens": 50}))
            await wait_until(lambda: live.pool.running == 1, what="the slot to be taken")
            async with http.stream("POST", "/generate_stream", json={"inputs": "x"}) as r:
                raw = await r.aread()
            assert r.status_code == 429 and orjson.loads(raw)["error_type"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 1
            assert (await busy).status_code == 200


@pytest.mark.asyncio
async def test_a_disconnect_mid_stream_aborts_the_engine_request(tmp_path: Path) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path), itl=0.05) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            for path, body in (("/generate_stream", {"inputs": "x"}),
                               ("/generate", {"prompt": "x", "max_tokens": 100, "stream": True})):
                async with http.stream("POST", path, json=body) as r:
                    async for line in r.aiter_lines():
                        if line:
                            break
        engine = live.pool.workers[0].engine
        await wait_until(lambda: len(engine.aborted) == 2 and live.pool.running == 0, what="the aborts")  # type: ignore[attr-defined]


NEW_ROUTES = {
    ("/v1/responses", "post"), ("/v1/responses/{response_id}", "get"), ("/v1/responses/{response_id}", "delete"),
    ("/v1/responses/{response_id}/input_items", "get"), ("/v1/messages", "post"),
    ("/v1/messages/count_tokens", "post"), ("/generate", "post"), ("/generate_stream", "post"),
}


@pytest.mark.asyncio
async def test_new_routes_are_published_and_counted(tmp_path: Path) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path)) as live, httpx.AsyncClient(base_url=live.url) as http:
        spec = (await http.get("/openapi.json")).json()
        published = {(p, m) for p, ops in spec["paths"].items() for m in ops}
        assert NEW_ROUTES <= published
        msgs = [{"role": "user", "content": "x"}]
        calls = [
            ("POST", "/v1/responses", {"model": "sim", "input": "x"}),
            ("GET", "/v1/responses/resp_nope", None),
            ("DELETE", "/v1/responses/resp_nope", None),
            ("GET", "/v1/responses/resp_nope/input_items", None),
            ("POST", "/v1/messages", {"model": "sim", "max_tokens": 5, "messages": msgs}),
            ("POST", "/v1/messages/count_tokens", {"model": "sim", "messages": msgs}),
            ("POST", "/generate", {"prompt": "x"}),
            ("POST", "/generate_stream", {"inputs": "x"}),
        ]
        for method, path, body in calls:
            await http.request(method, path, json=body)
        metrics = (await http.get("/metrics")).text
        for path, method in NEW_ROUTES:
            assert metric_value(metrics, "npugw_http_requests_total", route=path, method=method.upper()) == 1, path


@pytest.mark.asyncio
async def test_tgi_compat_route_answers_a_list_or_streams(tmp_path: Path) -> None:
    """POST / is what the `text-generation` client calls (TGI's compat route)."""
    async with serve_scripted(Settings(data_dir=tmp_path)) as live, httpx.AsyncClient(base_url=live.url) as http:
        body = {"inputs": "Hi. ", "parameters": {"max_new_tokens": 50, "details": True}}
        r = await http.post("/", json=body)
        assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 1
        assert r.json()[0]["generated_text"] == DEFAULT and r.json()[0]["details"]["generated_tokens"] > 0
        r = await http.post("/", json={**body, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        assert tgi_events(r.text)[-1]["generated_text"] == DEFAULT
        r = await http.post("/", json={"inputs": "x", "parameters": {"max_new_tokens": 10**6}})
        assert r.status_code == 422 and r.json()["error_type"] == "validation"
