"""The other client APIs in the gateway tier: a gateway-only app (`--model
none`) in front of recording nodes on a real uvicorn socket. A node that
serves Responses, Messages, count_tokens and /generate (its /openapi.json
says so) gets the client's request as it came, with only `model` set to its
own id, and the client gets the node's answer (model as the client named
it, the node's usage counted for the key, its refusals in the API's own
shape). A node that serves only chat, completions and /tokenize gets the
route's translation, and the client still gets the API's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from fakes import FakeNode
from sim_app import serve
from support import metric_value

from engine_adapter.apis import apis_from_openapi
from engine_adapter.backends.remote import build_remote_pool
from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import UpstreamConfig
from server.settings import Settings

ALL = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/generate", "/generate_stream")
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def sse(kind: str | None, obj: Any) -> bytes:
    return (f"event: {kind}\n".encode() if kind else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"


def _const(obj: Any) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.Response() if obj is None else web.json_response(obj)

    return handler


class ApiNode(FakeNode):
    """A node that records what it gets. It serves chat, completions and
    /tokenize always, and the paths in `native` (listed in its
    /openapi.json), answering in each API's shape with fixed usage. `status`
    makes every POST fail in the path's own error shape."""

    def __init__(self, native: tuple[str, ...] = ALL, openapi: bool = True) -> None:
        super().__init__()
        self.native = native
        self.openapi = openapi

    def routes(self, app: web.Application) -> None:
        if self.openapi:
            paths = {p: {"post": {}} for p in ("/v1/chat/completions", "/v1/completions", "/tokenize", *self.native)}
            if "/generate" in self.native:  # npu-gateway's /generate takes both shapes
                paths["/generate"] = {"post": {"requestBody": {"content": {"application/json": {"schema": {
                    "anyOf": [{"properties": {"prompt": {}}}, {"properties": {"inputs": {}}}]}}}}}}
            app.router.add_get("/openapi.json", _const({"paths": paths}))
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", *self.native):
            app.router.add_post(path, self.answer)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        self.calls.append((path, body, {k.lower(): v for k, v in request.headers.items()}))
        if self.status != 200:
            return web.json_response(self.error(path), status=self.status)
        model = body["model"]
        if path == "/v1/messages/count_tokens":
            return web.json_response({"input_tokens": 13})
        if path == "/tokenize":
            return web.json_response({"count": 21, "max_model_len": 2048, "tokens": list(range(21))})
        events = self.events(path, body, model)
        if isinstance(events, dict):
            return web.json_response(events)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
        return resp

    def error(self, path: str) -> dict[str, Any]:
        if path.startswith("/v1/messages"):
            return {"type": "error", "error": {"type": "invalid_request_error", "message": "node says no"}}
        if path.startswith("/generate"):
            return {"error": "node says no", "error_type": "validation"}
        return {"error": {"message": "node says no", "type": "BadRequestError", "code": self.status}}

    def events(self, path: str, body: dict[str, Any], model: str) -> list[bytes] | dict[str, Any]:
        stream = bool(body.get("stream")) or path == "/generate_stream"
        if path == "/v1/responses":
            usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 3,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
            msg = {"id": "msg_n", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Hi there", "annotations": []}]}
            done = {"id": "resp_node", "object": "response", "created_at": 1, "status": "completed", "model": model,
                    "output": [msg], "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
            if not stream:
                return done
            start = {**done, "status": "in_progress", "output": [], "usage": None}
            item = {**msg, "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            return [sse("response.created", {"type": "response.created", "sequence_number": 0, "response": start}),
                    sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1,
                                                       "output_index": 0, "item": item}),
                    sse("response.content_part.added", {"type": "response.content_part.added", "sequence_number": 2,
                                                        "item_id": "msg_n", "output_index": 0, "content_index": 0,
                                                        "part": part}),
                    sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 3,
                                                       "item_id": "msg_n", "output_index": 0, "content_index": 0,
                                                       "delta": "Hi there", "logprobs": []}),
                    sse("response.completed", {"type": "response.completed", "sequence_number": 4, "response": done})]
        if path == "/v1/messages":
            usage = {"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 2,
                     "cache_creation_input_tokens": 0}
            done = {"id": "msg_node", "type": "message", "role": "assistant", "model": model,
                    "content": [{"type": "text", "text": "Hi there"}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": usage}
            if not stream:
                return done
            return [sse("message_start", {"type": "message_start", "message": {
                        **done, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}}),
                    sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}),
                    sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": "Hi there"}}),
                    sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                             "stop_sequence": None},
                                          "usage": {"output_tokens": 4}}),
                    sse("message_stop", {"type": "message_stop"})]
        if path == "/generate" and "prompt" in body:
            words = [" Paris", " is", " nice"]
            if not stream:
                return {"text": [body["prompt"] + "".join(words)]}
            return [orjson.dumps({"text": [body["prompt"] + "".join(words[: i + 1])]}) + b"\n" for i in range(3)]
        if path in ("/generate", "/generate_stream"):
            details = {"finish_reason": "length", "generated_tokens": 3, "seed": None, "prefill": [], "tokens": []}
            if not stream:
                return {"generated_text": " Paris is nice", **({"details": details}
                                                               if body["parameters"].get("details") else {})}
            toks = [" Paris", " is", " nice"]
            return [b"data:" + orjson.dumps({"index": i + 1, "token": {"id": 7 + i, "text": t, "logprob": -0.5,
                                                                       "special": False}, "top_tokens": None,
                                             "generated_text": " Paris is nice" if i == 2 else None,
                                             "details": None}) + b"\n\n" for i, t in enumerate(toks)]
        # chat or completions (what a translated request is sent as)
        assert body.get("stream") is True, "a translated request is streamed"
        chat = path == "/v1/chat/completions"
        head = {"id": "cmpl-node", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                "model": model}
        out = []
        tool = chat and body.get("tools") and body.get("tool_choice") not in (None, "none", "auto")
        if tool:
            call = {"index": 0, "id": "call_n1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": '}}
            more = {"index": 0, "function": {"arguments": '"Paris"}'}}
            out += [{"index": 0, "delta": {"tool_calls": [call]}}, {"index": 0, "delta": {"tool_calls": [more]}}]
        else:
            for w in ("Bonjour", " Paris"):
                out.append({"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w})
        last = {"index": 0, "finish_reason": "tool_calls" if tool else "length"}
        out.append({**last, "delta": {}} if chat else {**last, "text": ""})
        chunks = [b"data: " + orjson.dumps({**head, "choices": [c]}) + b"\n\n" for c in out]
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22}
            chunks.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
        return [*chunks, b"data: [DONE]\n\n"]


@pytest_asyncio.fixture
async def native() -> AsyncIterator[ApiNode]:
    n = await ApiNode().start()
    yield n
    await n.stop()


@pytest_asyncio.fixture
async def plain() -> AsyncIterator[ApiNode]:
    n = await ApiNode(native=()).start()
    yield n
    await n.stop()


def tier(*upstreams: str) -> Settings:
    return Settings(model="none", upstream=list(upstreams), readiness_interval=1, admin_api_key="adm")


def tokens(metrics: str, kind: str) -> float:
    return metric_value(metrics, "npugw_api_key_tokens_total", model_name="remote", type=kind)


def test_the_apis_are_read_from_an_openapi_document() -> None:
    gateway = {"paths": {p: {"post": {}} for p in ALL} | {"/generate": {"post": {"requestBody": {"$ref": "#/c/G"}}}},
               "c": {"G": {"anyOf": [{"properties": {"prompt": {}}}, {"properties": {"inputs": {}}}]}}}
    assert apis_from_openapi(gateway) == {"responses", "messages", "count_tokens", "generate", "tgi"}
    tgi = {"paths": {"/generate": {"post": {"requestBody": {"content": {"application/json": {"schema": {
        "properties": {"inputs": {}, "parameters": {}}}}}}}}, "/generate_stream": {"post": {}}}}
    assert apis_from_openapi(tgi) == {"tgi"}
    vllm_serve = {"paths": {"/v1/responses": {"post": {}}, "/v1/messages": {"post": {}}, "/v1/models": {"get": {}}}}
    assert apis_from_openapi(vllm_serve) == {"responses", "messages"}
    assert apis_from_openapi({"openapi": "3"}) == frozenset()
    with pytest.raises(ValueError, match="unknown api chat"):
        Settings(model="none", upstream=["x=http://127.0.0.1:1;api=messages,chat"])


@pytest.mark.asyncio
async def test_admin_routes_show_each_node_apis(native: ApiNode, plain: ApiNode) -> None:
    bare = await ApiNode(native=(), openapi=False).start()
    try:
        async with serve(None, tier(f"remote={native.url}", f"plain={plain.url}", f"bare={bare.url}",
                                    f"told={bare.url};api=messages,tgi")) as (client, _):
            routes = (await client.get("/admin/routes", headers={"Authorization": "Bearer adm"})).json()
            apis = {u["upstream"]: u["urls"][0]["apis"] for u in routes["upstreams"]}
            assert apis == {"remote": ["count_tokens", "generate", "messages", "responses", "tgi"], "plain": [],
                            "bare": [], "told": ["messages", "tgi"]}
    finally:
        await bare.stop()


@pytest.mark.asyncio
async def test_responses_pass_through(native: ApiNode) -> None:
    async with serve(None, tier(f"remote={native.url}")) as (client, _):
        sdk = openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)
        extra = {"reasoning": {"effort": "low"}, "some_vendor_field": [1, 2]}
        r = await sdk.responses.create(model="remote", input="Hi", instructions="Be brief.", tools=[WEATHER],  # type: ignore[list-item]
                                       extra_body=extra)
        path, got, _ = native.calls[-1]
        assert path == "/v1/responses" and got == {"model": "node-model", "input": "Hi", "instructions": "Be brief.",
                                                   "tools": [WEATHER], **extra}
        assert r.id == "resp_node" and r.model == "remote" and r.output_text == "Hi there"
        async with sdk.responses.stream(model="remote", input="Hi") as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
        assert native.calls[-1][:2] == ("/v1/responses", {"model": "node-model", "input": "Hi", "stream": True})
        assert kinds == ["response.created", "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta", "response.completed"]
        assert final.model == "remote" and final.output_text == "Hi there"
        metrics = (await client.get("/metrics")).text
        assert tokens(metrics, "prompt") == 2 * 9 and tokens(metrics, "completion") == 2 * 3
        await sdk.close()


@pytest.mark.asyncio
async def test_messages_and_count_tokens_pass_through(native: ApiNode) -> None:
    async with serve(None, tier(f"remote={native.url}")) as (client, _):
        sdk = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="x", max_retries=0)
        msgs: Any = [{"role": "user", "content": "Hi"}]
        m = await sdk.messages.create(model="remote", max_tokens=10, messages=msgs, system="Be brief.",
                                      extra_body={"top_k": 3})
        assert native.calls[-1][:2] == ("/v1/messages", {"model": "node-model", "max_tokens": 10, "messages": msgs,
                                                     "system": "Be brief.", "top_k": 3})
        assert m.model == "remote" and m.content[0].text == "Hi there"  # type: ignore[union-attr]
        async with sdk.messages.stream(model="remote", max_tokens=10, messages=msgs) as stream:
            text = await stream.get_final_text()
            final = await stream.get_final_message()
        assert native.calls[-1][1]["stream"] is True and text == "Hi there" and final.model == "remote"
        counted = await sdk.messages.count_tokens(model="remote", messages=msgs)
        assert counted.input_tokens == 13 and native.calls[-1][0] == "/v1/messages/count_tokens"
        metrics = (await client.get("/metrics")).text
        assert tokens(metrics, "prompt") == 2 * (7 + 2) and tokens(metrics, "completion") == 2 * 4
        native.status = 400  # the node's own refusal, in its own (Anthropic) shape
        with pytest.raises(anthropic.BadRequestError) as e:
            await sdk.messages.create(model="remote", max_tokens=10, messages=msgs)
        assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "node says no"}}
        await sdk.close()


@pytest.mark.asyncio
async def test_generate_shapes_pass_through(native: ApiNode) -> None:
    async with serve(None, tier(f"remote={native.url}")) as (client, _):
        body = {"prompt": "The capital is", "max_tokens": 5}
        r = await client.post("/generate", json=body)
        assert r.json() == {"text": ["The capital is Paris is nice"]}
        assert native.calls[-1][:2] == ("/generate", {**body, "model": "node-model"})
        r = await client.post("/generate", json={**body, "stream": True})
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert r.headers["content-type"].startswith("application/x-ndjson") and len(lines) == 3
        assert lines[-1]["text"] == ["The capital is Paris is nice"]
        tgi = {"inputs": "The capital is", "parameters": {"max_new_tokens": 5, "details": True}}
        r = await client.post("/generate", json=tgi)
        assert r.json()["generated_text"] == " Paris is nice" and r.json()["details"]["generated_tokens"] == 3
        assert native.calls[-1][:2] == ("/generate", {**tgi, "model": "node-model"})
        r = await client.post("/generate_stream", json=tgi)
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert [e["token"]["id"] for e in events] == [7, 8, 9] and events[-1]["generated_text"] == " Paris is nice"
        assert native.calls[-1][0] == "/generate_stream"
        metrics = (await client.get("/metrics")).text
        assert tokens(metrics, "completion") == 2 * (len(" Paris is nice") // 4) + 3 + 3
        native.status = 422
        r = await client.post("/generate_stream", json=tgi)
        assert r.status_code == 422 and r.json() == {"error": "node says no", "error_type": "validation"}


@pytest.mark.asyncio
async def test_a_node_without_the_apis_gets_them_translated(plain: ApiNode) -> None:
    async with serve(None, tier(f"remote={plain.url}")) as (client, _):
        oai = openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)
        r = await oai.responses.create(model="remote", input="Hi", instructions="Be brief.", max_output_tokens=9)
        path, got, _ = plain.calls[-1]
        assert path == "/v1/chat/completions" and got["model"] == "node-model" and got["max_tokens"] == 9
        assert got["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert r.model == "remote" and r.output_text == "Bonjour Paris" and r.status == "incomplete"
        assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (17, 5)
        assert (await oai.responses.retrieve(r.id)).output_text == "Bonjour Paris"  # stored here
        forced: Any = {"type": "function", "name": "get_weather"}
        async with oai.responses.stream(model="remote", input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                        tool_choice=forced) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
        assert plain.calls[-1][1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        call = final.output[0]
        assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        chained = await oai.responses.create(model="remote", previous_response_id=final.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        sent = plain.calls[-1][1]["messages"]
        assert sent[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert sent[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
        assert chained.previous_response_id == final.id
        await oai.close()

        claude = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="x", max_retries=0)
        msgs: Any = [{"role": "user", "content": "Hi"}]
        m = await claude.messages.create(model="remote", max_tokens=9, messages=msgs)
        assert plain.calls[-1][0] == "/v1/chat/completions" and m.content[0].text == "Bonjour Paris"  # type: ignore[union-attr]
        assert m.stop_reason == "max_tokens" and (m.usage.input_tokens, m.usage.output_tokens) == (17, 5)
        tools: Any = [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]
        async with claude.messages.stream(model="remote", max_tokens=9, messages=msgs, tools=tools,
                                          tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            used = await stream.get_final_message()
        assert used.stop_reason == "tool_use" and used.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]
        assert used.usage.input_tokens == 17
        counted = await claude.messages.count_tokens(model="remote", messages=msgs)
        assert counted.input_tokens == 21 and plain.calls[-1][:2] == ("/tokenize", {"model": "node-model",
                                                                             "messages": msgs})
        await claude.close()

        r = await client.post("/generate", json={"prompt": "Say", "max_tokens": 4, "stream": True})
        assert plain.calls[-1][0] == "/v1/completions" and plain.calls[-1][1]["prompt"] == "Say"
        assert [json.loads(line)["text"] for line in r.text.splitlines()][-1] == ["SayBonjour Paris"]
        tgi = {"inputs": "Say", "parameters": {"max_new_tokens": 4, "details": True}}
        r = await client.post("/generate", json=tgi)
        assert r.json()["generated_text"] == "Bonjour Paris" and r.json()["details"]["generated_tokens"] == 5
        assert plain.calls[-1][1] == {"model": "node-model", "prompt": "Say", "max_tokens": 4, "temperature": 0.0,
                                      "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/generate_stream", json=tgi)
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert events[-1]["generated_text"] == "Bonjour Paris" and events[-1]["details"]["finish_reason"] == "length"
        plain.status = 400  # an OpenAI-shaped refusal, answered in the client's API's shape
        r = await client.post("/v1/messages", json={"model": "remote", "max_tokens": 5, "messages": msgs})
        assert r.status_code == 400 and r.json()["type"] == "error" and "node says no" in r.json()["error"]["message"]
        r = await client.post("/generate", json=tgi)
        assert r.status_code == 400 and r.json()["error_type"] == "validation"


@pytest.mark.asyncio
async def test_an_alias_of_a_local_engine_and_nodes_takes_the_form_of_the_target_it_picks(native: ApiNode) -> None:
    """Responses and Messages bind late, as chat does: on an alias whose
    targets mix a local engine and upstream nodes, the target admission
    picks decides whether the request is tokenized here or passed through
    (it was tokenized up front, and an upstream target refused it)."""
    local = WorkerPool("sim", lambda i: SimulatedEngine(SimulatedConfig(max_model_len=256), name="sim"),
                       readiness_interval=60)
    nodes = build_remote_pool(UpstreamConfig(name="remote", urls=(native.url,), health_interval=60),
                              readiness_interval=3600, probe_timeout=0.5)
    settings = Settings(alias=["to-node=remote:1,sim:0", "to-sim=sim:1,remote:0"], readiness_interval=1)
    async with serve([(local, ("sim",), "sim"), (nodes, ("remote",), "remote")], settings) as (client, _):
        oai = openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="x", max_retries=0)
        try:
            msgs: Any = [{"role": "user", "content": "Hi"}]
            r = await oai.responses.create(model="to-node", input="Hi")
            assert native.calls[-1][:2] == ("/v1/responses", {"model": "node-model", "input": "Hi"})
            assert r.model == "remote" and r.output_text == "Hi there"
            m = await claude.messages.create(model="to-node", max_tokens=10, messages=msgs)
            assert native.calls[-1][:2] == ("/v1/messages", {"model": "node-model", "max_tokens": 10, "messages": msgs})
            assert m.model == "remote" and m.content[0].text == "Hi there"  # type: ignore[union-attr]
            seen = len(native.calls)
            r = await oai.responses.create(model="to-sim", input="Hi", max_output_tokens=4)
            m = await claude.messages.create(model="to-sim", max_tokens=4, messages=msgs)
            assert len(native.calls) == seen  # the local engine answered both
            assert r.model == "sim" and r.usage is not None and r.usage.output_tokens == 4
            assert m.model == "sim" and m.usage.output_tokens == 4
            with pytest.raises(anthropic.BadRequestError) as e:  # validated with the local tokenizer before admission
                await claude.messages.create(model="to-sim", max_tokens=1000, messages=msgs)
            assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        finally:
            await oai.close()
            await claude.close()
