"""The other client APIs through the real vLLM engine (the session's real
gateway: SmolLM2-135M-Instruct): the official `openai` SDK on
`/v1/responses` (create, stream, a function call round trip, a
`previous_response_id` chain), the official `anthropic` SDK on
`/v1/messages` (create, stream, a tool_use round trip, count_tokens, error
types), and raw HTTP on `/generate` (vLLM's legacy shape, streamed one JSON
per line) and TGI's `/generate` and `/generate_stream`.

SmolLM2-135M rarely calls a tool on its own: the tool tests force a named
function (guided decoding), so the model must emit a call."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from support import EMBEDDED, GatewayProcess, metric_value

pytestmark = pytest.mark.engine
PARIS = "What is the capital of France?"
FORCED: Any = {"type": "function", "name": "get_weather"}
GREEDY: Any = {"temperature": 0}  # the anthropic SDK has no temperature argument
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMS}
ANTHROPIC_WEATHER: Any = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_PARAMS}


@pytest.fixture(scope="module")
def oai(real_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(real_gateway: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_gateway.url, api_key="unused", max_retries=0, timeout=120)


def chat_text(oai: openai.OpenAI, question: str, max_tokens: int) -> str:
    r = oai.chat.completions.create(model=EMBEDDED, messages=[{"role": "user", "content": question}],
                                    temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content or ""


# ---- OpenAI Responses -----------------------------------------------------------
def test_responses_create_equals_chat_and_is_stored(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=EMBEDDED, input=PARIS, temperature=0, max_output_tokens=20)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.model == EMBEDDED
    assert "Paris" in r.output_text
    assert r.output_text == chat_text(oai, PARIS, 20)  # the same prompt and sampling as chat
    assert r.usage is not None and 0 < r.usage.output_tokens <= 20 and r.usage.input_tokens > 5
    assert oai.responses.retrieve(r.id).output_text == r.output_text
    items = oai.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]


def test_responses_stream_events_add_up_to_the_final_response(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model=EMBEDDED, input=PARIS, temperature=0, max_output_tokens=40) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert "Paris" in text and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens >= types.count("response.output_text.delta") > 0


def test_responses_function_call_round_trip(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=EMBEDDED, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice=FORCED, temperature=0,
                                 max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)

    second = oai.responses.create(
        model=EMBEDDED, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "It is sunny and 21 C."}],
        temperature=0, max_output_tokens=40,
    )
    assert second.previous_response_id == first.id and second.output_text
    assert not [o for o in second.output if o.type == "function_call"]
    # the conversation reached the model: the prompt holds the question, the call and its output
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_previous_response_id_chain(oai: openai.OpenAI) -> None:
    r1 = oai.responses.create(model=EMBEDDED, input="My name is Zorblax. Say hello.", temperature=0,
                              max_output_tokens=20)
    r2 = oai.responses.create(model=EMBEDDED, input="What is my name?", previous_response_id=r1.id,
                              temperature=0, max_output_tokens=20)
    alone = oai.responses.create(model=EMBEDDED, input="What is my name?", temperature=0, max_output_tokens=20)
    assert r1.usage and r2.usage and alone.usage
    # r2's prompt holds r1's question and answer: longer than the question alone by at least both
    assert r2.usage.input_tokens >= alone.usage.input_tokens + r1.usage.output_tokens + 5
    assert r2.previous_response_id == r1.id
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=EMBEDDED, input="x", previous_response_id="resp_does_not_exist")
    oai.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r1.id)


# ---- Anthropic Messages ------------------------------------------------------------
def test_messages_create_and_count_tokens(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": PARIS}]
    m = claude.messages.create(model=EMBEDDED, max_tokens=20, messages=msgs, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == EMBEDDED
    assert m.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in m.content if b.type == "text")
    assert "Paris" in text and text == chat_text(oai, PARIS, 20)
    counted = claude.messages.count_tokens(model=EMBEDDED, messages=msgs)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5
    stopped = claude.messages.create(model=EMBEDDED, max_tokens=20, messages=msgs, extra_body=GREEDY,
                                     stop_sequences=["Paris"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    msgs: Any = [{"role": "user", "content": PARIS}]
    with claude.messages.stream(model=EMBEDDED, max_tokens=30, messages=msgs, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
        streamed = stream.get_final_text()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert "Paris" in streamed and final.usage.output_tokens > 0
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model=EMBEDDED, max_tokens=60, messages=ask, tools=[ANTHROPIC_WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first.content
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER_PARAMS)
    with claude.messages.stream(
        model=EMBEDDED, max_tokens=40, tools=[ANTHROPIC_WEATHER], extra_body=GREEDY,
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": "It is sunny and 21 C."}]}],
    ) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content
    assert second.usage.input_tokens > first.usage.input_tokens


def test_messages_error_types(claude: anthropic.Anthropic, real_gateway: GatewayProcess) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as nf:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=msgs)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=EMBEDDED, max_tokens=10**6, messages=msgs)
    assert bad.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": bad.value.body["error"]["message"]}}  # type: ignore[index]
    r = httpx.post(real_gateway.url + "/v1/messages", json={"model": EMBEDDED, "messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- /generate ---------------------------------------------------------------------
def test_vllm_generate_whole_and_streamed(real_gateway: GatewayProcess) -> None:
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(real_gateway.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()["text"]
    assert len(whole) == 1 and whole[0].startswith(prompt) and len(whole[0]) > len(prompt)
    lines = []
    with httpx.stream("POST", real_gateway.url + "/generate", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in s.iter_lines() if line]
    texts = [obj["text"][0] for obj in lines]
    assert len(texts) > 1 and all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == whole[0]


def test_tgi_generate_and_generate_stream(real_gateway: GatewayProcess) -> None:
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12, "details": True}}
    r = httpx.post(real_gateway.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    details = out["details"]
    assert out["generated_text"] and details["generated_tokens"] == len(details["tokens"]) > 0
    assert details["finish_reason"] in ("length", "eos_token")
    assert "".join(t["text"] for t in details["tokens"]).strip() in out["generated_text"]
    events = []
    with httpx.stream("POST", real_gateway.url + "/generate_stream", json=body, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == out["generated_text"]  # greedy: the same text
    assert "".join(e["token"]["text"] for e in events) == out["generated_text"]
    r = httpx.post(real_gateway.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 10**6}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_the_routes_are_published_and_counted(real_gateway: GatewayProcess) -> None:
    url = real_gateway.url
    calls = {
        "/v1/responses": {"model": EMBEDDED, "input": "hi", "max_output_tokens": 1},
        "/v1/messages": {"model": EMBEDDED, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/messages/count_tokens": {"model": EMBEDDED, "messages": [{"role": "user", "content": "hi"}]},
        "/generate": {"prompt": "hi", "max_tokens": 1},
        "/generate_stream": {"inputs": "hi", "parameters": {"max_new_tokens": 1}},
    }

    def count(route: str) -> float:
        try:
            return float(metric_value(httpx.get(url + "/metrics").text, "npugw_http_requests_total", route=route,
                                      status="200"))
        except KeyError:
            return 0.0

    paths = httpx.get(url + "/openapi.json").json()["paths"]
    for route, body in calls.items():
        assert "post" in paths[route], route
        before = count(route)
        r = httpx.post(url + route, json=body, timeout=120)
        assert r.status_code == 200, (route, r.text)
        assert count(route) == before + 1, route
