"""POST /v1/responses and the stored responses, with the official OpenAI SDK
over a real uvicorn socket on scripted simulated engines: text, streaming
events, a function call round trip (function_call_output), previous_response_id
chains, per-key visibility, the SQLite store across a restart, admission
statuses and disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from sdk_app import DEFAULT, SUNNY, serve_scripted
from support import metric_value, wait_until

from server.settings import Settings

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


Sdk = Callable[..., openai.AsyncOpenAI]


@pytest_asyncio.fixture
async def sdk() -> AsyncIterator[Sdk]:
    """`sdk(url, key)`: an AsyncOpenAI client, closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(url: str, key: str = "sk-a") -> openai.AsyncOpenAI:
        made.append(openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30))
        return made[-1]

    yield make
    for c in made:
        await c.close()


def keyed(tmp_path: Path, **kw: object) -> Settings:
    return Settings(api_key=["sk-a", "sk-b"], data_dir=tmp_path, **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_create_retrieve_input_items_delete(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        r = await client.responses.create(model="sim", input="Say something.", instructions="Be brief.",
                                          metadata={"team": "qa"})
        assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
        assert r.output_text == DEFAULT
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        assert r.usage is not None and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
        assert r.usage.input_tokens_details.cached_tokens == 0
        assert r.metadata == {"team": "qa"} and r.instructions == "Be brief."
        assert live.prompts[-1].startswith("<|im_start|>system\nBe brief.")

        got = await client.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == DEFAULT
        items = await client.responses.input_items.list(r.id)
        assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # type: ignore[union-attr]
        assert items.data[0].content[0].text == "Say something."  # type: ignore[union-attr]

        short = await client.responses.create(model="sim", input="x", max_output_tokens=2)
        assert short.status == "incomplete" and short.incomplete_details is not None
        assert short.incomplete_details.reason == "max_output_tokens"

        deleted = await client.responses.delete(r.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(r.id)


@pytest.mark.asyncio
async def test_stream_event_sequence_and_final_response(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        async with client.responses.stream(model="sim", input="Say something.") as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert set(types[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == DEFAULT  # type: ignore[union-attr]
        assert final.output_text == DEFAULT and final.status == "completed"
        assert final.usage is not None and final.usage.output_tokens == len(types) - 8
        stored = await client.responses.retrieve(final.id)  # streamed responses are stored too
        assert stored.output_text == DEFAULT


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True])
async def test_function_call_round_trip(tmp_path: Path, streamed: bool, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        ask = {"model": "sim", "input": "What is the weather in Paris?", "tools": [WEATHER_TOOL]}
        if streamed:
            async with client.responses.stream(**ask) as stream:  # type: ignore[arg-type]
                events = [e async for e in stream]
                first = await stream.get_final_response()
            types = [e.type for e in events]
            assert "response.function_call_arguments.delta" in types
            assert "response.function_call_arguments.done" in types
            assert "response.output_text.delta" not in types
        else:
            first = await client.responses.create(**ask)  # type: ignore[arg-type]
        calls = [o for o in first.output if o.type == "function_call"]
        assert len(calls) == 1 and first.output == calls
        call = calls[0]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")

        # the caller runs the function, and answers with its output
        second = await client.responses.create(
            model="sim", previous_response_id=first.id, tools=[WEATHER_TOOL],  # type: ignore[list-item]
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}],
        )
        assert second.output_text == SUNNY and second.previous_response_id == first.id
        prompt = live.prompts[-1]
        assert "What is the weather in Paris?" in prompt and '<|im_start|>tool\n{"sky": "sunny"}' in prompt

        # the same without the store: the whole conversation sent as items
        third = await client.responses.create(
            model="sim", store=False, tools=[WEATHER_TOOL],  # type: ignore[list-item]
            input=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ],
        )
        assert third.output_text == SUNNY and third.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(third.id)


@pytest.mark.asyncio
async def test_previous_response_id_chain_rebuilds_the_conversation(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        r1 = await client.responses.create(model="sim", input="first question", instructions="ONE")
        r2 = await client.responses.create(model="sim", input="second question", previous_response_id=r1.id)
        r3 = await client.responses.create(model="sim", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "third question"}]}], previous_response_id=r2.id, instructions="THREE")
        prompt = live.prompts[-1]
        order = ["system\nTHREE", "first question", DEFAULT, "second question", DEFAULT, "third question"]
        at = [prompt.find(s, prompt.find(order[i - 1]) + 1 if i else 0) for i, s in enumerate(order)]
        assert all(a >= 0 for a in at) and at == sorted(at), prompt
        assert "ONE" not in prompt  # instructions are not carried over, as OpenAI's
        assert r3.previous_response_id == r2.id
        items = await client.responses.input_items.list(r3.id)
        assert len(items.data) == 1  # this response's own input

        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model="sim", input="x", previous_response_id="resp_nope")
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.asyncio
async def test_a_key_sees_only_its_own_responses(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        a, b = sdk(live.url, "sk-a"), sdk(live.url, "sk-b")
        r = await a.responses.create(model="sim", input="secret")
        for call in (b.responses.retrieve(r.id), b.responses.delete(r.id), b.responses.input_items.list(r.id),
                     b.responses.create(model="sim", input="x", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await a.responses.retrieve(r.id)).id == r.id
        with pytest.raises(openai.AuthenticationError):
            await sdk(live.url, "sk-wrong").responses.retrieve(r.id)


@pytest.mark.asyncio
async def test_stored_responses_survive_a_restart_and_hold_no_key(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        r = await sdk(live.url).responses.create(model="sim", input="remember me")
    db = tmp_path / "responses.db"
    assert db.exists() and b"sk-a" not in db.read_bytes()  # the key's name only (key-1)
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        assert (await client.responses.retrieve(r.id)).output_text == DEFAULT
        follow = await client.responses.create(model="sim", input="and then?", previous_response_id=r.id)
        assert "remember me" in live.prompts[-1] and follow.status == "completed"


@pytest.mark.asyncio
async def test_bad_input_and_refusals_are_openai_statuses(tmp_path: Path, sdk: Sdk) -> None:
    settings = Settings(data_dir=tmp_path)
    async with serve_scripted(settings, itl=0.05, slots_per_worker=1, max_queue_size=0) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            for body, param in [
                ({"model": "sim"}, "input"),
                ({"model": "sim", "input": [{"type": "reasoning"}]}, "input"),
                ({"model": "sim", "input": "x", "temperature": 9}, "temperature"),
                ({"model": "sim", "input": "x", "max_output_tokens": 99999}, "max_output_tokens"),
                ({"model": "sim", "input": "x", "tool_choice": "required"}, "tool_choice"),
                ({"model": "sim", "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
            ]:
                r = await http.post("/v1/responses", json=body)
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
            r = await http.post("/v1/responses", json={"model": "nope", "input": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

            busy = asyncio.ensure_future(http.post("/v1/responses", json={"model": "sim", "input": "x"}))
            await wait_until(lambda: live.pool.running == 1, what="the slot to be taken")
            async with http.stream("POST", "/v1/responses", json={"model": "sim", "input": "x", "stream": True}) as r:
                raw = await r.aread()
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.headers["content-type"].startswith("application/json") and b"event:" not in raw
            assert (await busy).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert metric_value(metrics, "npugw_http_requests_total", route="/v1/responses", status="429") == 1
            assert metric_value(metrics, "npugw_http_requests_total", route="/v1/responses", status="200") == 1


@pytest.mark.asyncio
async def test_a_disconnect_mid_stream_aborts_the_engine_request(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path), itl=0.05) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            body = {"model": "sim", "input": "x", "stream": True}
            async with http.stream("POST", "/v1/responses", json=body) as r:
                async for line in r.aiter_lines():
                    if "output_text.delta" in line:
                        break
        engine = live.pool.workers[0].engine
        await wait_until(lambda: len(engine.aborted) == 1 and live.pool.running == 0, what="the abort")  # type: ignore[attr-defined]
