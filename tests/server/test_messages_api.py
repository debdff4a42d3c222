"""POST /v1/messages and /v1/messages/count_tokens with the official
Anthropic SDK over a real uvicorn socket on scripted simulated engines:
text, the event stream, a tool_use round trip (streamed and not), stop
sequences, token counts, and Anthropic's error types and statuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anthropic
import httpx
import pytest
import pytest_asyncio
from sdk_app import DEFAULT, SUNNY, serve_scripted
from support import metric_value, wait_until

from server.settings import Settings

WEATHER = {
    "name": "get_weather", "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
Sdk = Callable[..., anthropic.AsyncAnthropic]


@pytest_asyncio.fixture
async def sdk() -> AsyncIterator[Sdk]:
    made: list[anthropic.AsyncAnthropic] = []

    def make(url: str, key: str = "sk-a") -> anthropic.AsyncAnthropic:
        made.append(anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=30))
        return made[-1]

    yield make
    for c in made:
        await c.close()


def keyed(tmp_path: Path, **kw: object) -> Settings:
    return Settings(api_key=["sk-a"], data_dir=tmp_path, **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_create_text_stop_reasons_and_count_tokens(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)  # the SDK sends x-api-key and anthropic-version
        m = await client.messages.create(model="sim", max_tokens=100, system="Be brief.",
                                         messages=[{"role": "user", "content": "Say something."}],
                                         metadata={"user_id": "u1"})
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == DEFAULT  # type: ignore[union-attr]
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        assert m.usage.output_tokens > 0 and live.prompts[-1].startswith("<|im_start|>system\nBe brief.")
        count = await client.messages.count_tokens(model="sim", system="Be brief.",
                                                   messages=[{"role": "user", "content": "Say something."}])
        assert count.input_tokens == m.usage.input_tokens

        short = await client.messages.create(model="sim", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
        stopped = await client.messages.create(model="sim", max_tokens=100, stop_sequences=["fox"],
                                               messages=[{"role": "user", "content": "x"}])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "fox"
        assert stopped.content[0].text == "The quick brown "  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_stream_text_events(tmp_path: Path, sdk: Sdk) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        async with client.messages.stream(model="sim", max_tokens=100,
                                          messages=[{"role": "user", "content": "Say something."}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == DEFAULT and final.content[0].text == DEFAULT  # type: ignore[union-attr]
        assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
        async with httpx.AsyncClient(base_url=live.url, headers={"x-api-key": "sk-a"}) as http:
            body = {"model": "sim", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "x"}]}
            r = await http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True])
async def test_tool_use_round_trip(tmp_path: Path, sdk: Sdk, streamed: bool) -> None:
    async with serve_scripted(keyed(tmp_path)) as live:
        client = sdk(live.url)
        if streamed:
            async with client.messages.stream(model="sim", max_tokens=200, tools=[WEATHER],  # type: ignore[list-item]
                                              messages=ASK) as stream:  # type: ignore[arg-type]
                kinds = [e.type async for e in stream]
                first = await stream.get_final_message()
            assert "input_json" in kinds or "content_block_delta" in kinds
        else:
            first = await client.messages.create(model="sim", max_tokens=200, tools=[WEATHER],  # type: ignore[list-item]
                                                 messages=ASK)  # type: ignore[arg-type]
        assert first.stop_reason == "tool_use"
        uses = [b for b in first.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"}
        assert uses[0].id.startswith("toolu_")

        second = await client.messages.create(
            model="sim", max_tokens=200, tools=[WEATHER],  # type: ignore[list-item]
            messages=[*ASK, {"role": "assistant", "content": first.content},  # type: ignore[list-item]
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                    "content": "sunny, 21 C"}]}],
        )
        assert second.stop_reason == "end_turn" and second.content[0].text == SUNNY  # type: ignore[union-attr]
        assert "<|im_start|>tool\nsunny, 21 C" in live.prompts[-1]


@pytest.mark.asyncio
async def test_error_types_and_statuses(tmp_path: Path, sdk: Sdk) -> None:
    settings = Settings(api_keys_file=None, api_key=["sk-a"], data_dir=tmp_path, max_request_body_bytes=4096)
    async with serve_scripted(settings, itl=0.05, slots_per_worker=1, max_queue_size=0) as live:
        client = sdk(live.url)
        msgs = [{"role": "user", "content": "x"}]
        cases: list[tuple[type[Exception], str, anthropic.AsyncAnthropic, dict[str, object]]] = [
            (anthropic.NotFoundError, "not_found_error", client, {"model": "nope"}),
            (anthropic.AuthenticationError, "authentication_error", sdk(live.url, "sk-wrong"), {}),
            (anthropic.BadRequestError, "invalid_request_error", client, {"extra_body": {"temperature": 1.5}}),
            (anthropic.BadRequestError, "invalid_request_error", client,
             {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        ]
        for exc, kind, c, extra in cases:
            with pytest.raises(exc) as e:
                await c.messages.create(**{"model": "sim", "max_tokens": 10, "messages": msgs, **extra})  # type: ignore[arg-type]
            assert e.value.body == {"type": "error", "error": {"type": kind, "message": e.value.body["error"]["message"]}}  # type: ignore[attr-defined,index]

        async with httpx.AsyncClient(base_url=live.url, headers={"x-api-key": "sk-a"}, timeout=30) as http:
            r = await http.post("/v1/messages", json={"model": "sim", "messages": msgs})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert "max_tokens" in r.json()["error"]["message"]
            r = await http.post("/v1/messages", json={"model": "sim", "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "x" * 5000}]})
            assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
            r = await http.post("/v1/messages", content=b"x", headers={"content-type": "text/plain"})
            assert r.status_code == 415 and r.json()["type"] == "error"
            r = await http.get("/v1/messages")
            assert r.status_code == 405 and r.json()["type"] == "error"

            # a full queue: Anthropic's 529 overloaded, before any stream byte
            busy = asyncio.ensure_future(http.post("/v1/messages", json={"model": "sim", "max_tokens": 50,
                                                                         "messages": msgs}))
            await wait_until(lambda: live.pool.running == 1, what="the slot to be taken")
            with pytest.raises(anthropic.APIStatusError) as e:
                async with client.messages.stream(model="sim", max_tokens=10, messages=msgs) as s:  # type: ignore[arg-type]
                    await s.get_final_message()
            assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            assert int(e.value.response.headers["retry-after"]) >= 1
            assert (await busy).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert metric_value(metrics, "npugw_http_requests_total", route="/v1/messages", status="529") == 1


@pytest.mark.asyncio
async def test_a_disconnect_mid_stream_aborts_the_engine_request(tmp_path: Path) -> None:
    async with serve_scripted(Settings(data_dir=tmp_path), itl=0.05) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            body = {"model": "sim", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "x"}]}
            async with http.stream("POST", "/v1/messages", json=body) as r:
                async for line in r.aiter_lines():
                    if "text_delta" in line:
                        break
        engine = live.pool.workers[0].engine
        await wait_until(lambda: len(engine.aborted) == 1 and live.pool.running == 0, what="the abort")  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_a_tool_use_input_with_a_huge_integer_is_served(tmp_path: Path) -> None:
    """orjson refuses integers past 64 bits (found by schemathesis: a 500)."""
    async with serve_scripted(Settings(data_dir=tmp_path)) as live, httpx.AsyncClient(base_url=live.url) as http:
        msgs = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"n": 2**70}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]
        r = await http.post("/v1/messages", json={"model": "sim", "max_tokens": 5, "messages": msgs})
        assert r.status_code == 200, r.text
