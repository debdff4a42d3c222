"""The OpenAI surface through the real vLLM engine: every parameter has a
test that would fail if it were ignored."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from support import EMBEDDED, EMBEDDING, GatewayProcess

pytestmark = pytest.mark.engine
Q = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def client(real_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = Q, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=EMBEDDED, messages=messages, **kw)  # type: ignore[arg-type]


def text(r: Any, i: int = 0) -> str:
    return str(r.choices[i].message.content or "")


def test_stop_truncates_and_is_not_returned(client: openai.OpenAI) -> None:
    base = text(chat(client, temperature=0))
    assert "Paris" in base
    r = chat(client, temperature=0, stop=["Paris"])
    assert "Paris" not in text(r) and r.choices[0].finish_reason == "stop"
    assert base.startswith(text(r))
    r2 = chat(client, temperature=0, stop="capital")
    assert "capital" not in text(r2)


def test_n_gives_n_choices_stream_and_not(client: openai.OpenAI) -> None:
    r = chat(client, n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason for c in r.choices)
    seen: dict[int, str] = {}
    for chunk in chat(client, n=3, temperature=1.0, seed=7, max_tokens=8, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                seen[c.index] = c.finish_reason
    assert sorted(seen) == [0, 1, 2]


def test_seed_repeats_sampled_text(client: openai.OpenAI) -> None:
    a = text(chat(client, STORY, temperature=1.2, seed=1234, max_tokens=30))
    b = text(chat(client, STORY, temperature=1.2, seed=1234, max_tokens=30))
    others = {text(chat(client, STORY, temperature=1.2, seed=s, max_tokens=30)) for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # the seed matters


@pytest.mark.parametrize("param", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_truncation_params_remove_sampling_randomness(client: openai.OpenAI, param: dict[str, Any]) -> None:
    # Completions prompt without bf16 logit ties in its first 20 tokens (with a
    # tie, vLLM's top-k keeps every tied token and the seed still matters).
    def run(seed: int, **kw: Any) -> str:
        r = client.completions.create(
            model=EMBEDDED, prompt="Once upon a time", temperature=2.0, seed=seed, max_tokens=20, **kw
        )
        return r.choices[0].text

    assert run(11) != run(12)  # without truncation, temperature 2 wanders with the seed
    extra = {k: v for k, v in param.items() if k == "top_p"}
    body = {k: v for k, v in param.items() if k != "top_p"}
    assert run(11, extra_body=body, **extra) == run(12, extra_body=body, **extra)


@pytest.mark.parametrize(
    "kw",
    [
        {"extra_body": {"repetition_penalty": 1.9}},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ],
)
def test_penalties_change_greedy_text(client: openai.OpenAI, kw: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": "Repeat the word cat ten times."}]
    forced = {"ignore_eos": True}
    greedy = text(chat(client, msgs, temperature=0, max_tokens=40, extra_body=forced))
    kw = {**kw, "extra_body": {**forced, **kw.get("extra_body", {})}}
    assert text(chat(client, msgs, temperature=0, max_tokens=40, **kw)) != greedy


def test_logit_bias_forces_and_bans_tokens(real_gateway: GatewayProcess, client: openai.OpenAI) -> None:
    tok = httpx.post(real_gateway.url + "/tokenize", json={"model": EMBEDDED, "prompt": " banana", "add_special_tokens": False}).json()
    banana = tok["tokens"][0]
    r = chat(client, temperature=0, max_tokens=3, logit_bias={str(banana): 100})
    assert text(r).count("banana") >= 2
    paris = httpx.post(real_gateway.url + "/tokenize", json={"model": EMBEDDED, "prompt": " Paris", "add_special_tokens": False}).json()["tokens"][0]
    assert "Paris" not in text(chat(client, temperature=0, logit_bias={str(paris): -100}))


def test_ignore_eos_min_tokens_max_completion_tokens(client: openai.OpenAI) -> None:
    normal = chat(client, temperature=0, max_tokens=40)
    assert normal.usage.completion_tokens < 20 and normal.choices[0].finish_reason == "stop"
    forced = chat(client, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 40 and forced.choices[0].finish_reason == "length"
    at_least = chat(client, temperature=0, max_tokens=40, extra_body={"min_tokens": 25})
    assert at_least.usage.completion_tokens >= 25
    short = client.chat.completions.create(model=EMBEDDED, messages=Q, max_completion_tokens=3)  # type: ignore[arg-type]
    assert short.usage is not None and short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"


def test_chat_logprobs_shape_and_order(client: openai.OpenAI) -> None:
    r = chat(client, temperature=0, logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(text(r))
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode())
        lps = [t.logprob for t in c.top_logprobs]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        assert math.isclose(c.logprob, lps[0], abs_tol=1e-4)  # greedy picks the top token
    streamed = []
    for chunk in chat(client, temperature=0, logprobs=True, top_logprobs=2, max_tokens=8, stream=True):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [c.token for c in streamed] == [c.token for c in content]


def test_completion_logprobs_echo_and_prompt_list(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=EMBEDDED, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    e = client.completions.create(model=EMBEDDED, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert e.choices[0].text == prompt + r.choices[0].text
    el = client.completions.create(model=EMBEDDED, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    elp = el.choices[0].logprobs
    assert elp is not None and elp.token_logprobs[0] is None and len(elp.tokens) > 2
    many = client.completions.create(model=EMBEDDED, prompt=["Paris is in", "Berlin is in"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    single = client.completions.create(model=EMBEDDED, prompt="Berlin is in", max_tokens=4, temperature=0)
    assert many.choices[1].text == single.choices[0].text
    ids = client.completions.create(model=EMBEDDED, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert ids.choices[0].text


def test_json_object_and_json_schema(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give the name and age of a person in JSON."}]
    calm = {"repetition_penalty": 1.15}  # keeps the 135M model from looping
    plain = text(chat(client, ask, temperature=0, max_tokens=200, extra_body=calm))
    r = chat(client, ask, temperature=0, max_tokens=200, extra_body=calm, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text(r)), dict)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # without the constraint, the model answers in prose
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = chat(client, [{"role": "user", "content": "Invent a person."}], temperature=0, max_tokens=80,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(text(r)), schema)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_parses_and_validates(client: openai.OpenAI, choice: Any) -> None:
    # one call: with parallel calls allowed the 135M model may repeat its call until max_tokens (it did in float32)
    r = chat(client, ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=80,
             parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id and call.type == "function"
    params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"


def test_streamed_tool_call_reassembles(client: openai.OpenAI) -> None:
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    stream = chat(client, ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=80, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
    assert reasons == ["tool_calls"]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_tool_choice_none_gives_text(client: openai.OpenAI) -> None:
    r = chat(client, ASK, tools=[WEATHER], tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_history_is_rendered_by_the_template(real_gateway: GatewayProcess, client: openai.OpenAI) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    t = httpx.post(real_gateway.url + "/tokenize", json={"model": EMBEDDED, "messages": history}).json()
    prompt = httpx.post(real_gateway.url + "/detokenize", json={"model": EMBEDDED, "tokens": t["tokens"]}).json()["prompt"]
    assert "<tool_response>\n21 degrees and sunny\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt and '"city": "Paris"' in prompt
    r = chat(client, history, tools=[WEATHER], temperature=0)
    assert r.choices[0].message.content


def test_content_parts_and_roles(client: openai.OpenAI) -> None:
    parts = [{"role": "developer", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    assert "Paris" in text(chat(client, parts, temperature=0))


def test_embeddings_similarity_formats_and_limits(client: openai.OpenAI, real_gateway: GatewayProcess) -> None:
    sents = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply."]
    r = client.embeddings.create(model=EMBEDDING, input=sents)
    vecs = [d.embedding for d in r.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2]) + 0.3
    b64 = httpx.post(real_gateway.url + "/v1/embeddings", json={"model": EMBEDDING, "input": sents[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack("<384f", raw)) == pytest.approx(vecs[0], abs=1e-5)
    ids = httpx.post(real_gateway.url + "/tokenize", json={"model": EMBEDDING, "prompt": sents[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=EMBEDDING, input=[ids])
    assert by_ids.data[0].embedding == pytest.approx(vecs[0], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBEDDING, input="x", dimensions=128)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "dimensions"


def test_embedding_engine_starts_on_first_use(real_gateway: GatewayProcess) -> None:
    """The default on CPU (--embedding-start auto): the session gateway came
    up without its embedding engine; the first embeddings request started it
    (tests/conftest.py `first_embedding_use` recorded what the gateway showed)."""
    seen: dict[str, Any] = real_gateway.embedding_first_use  # type: ignore[attr-defined]
    before, after = seen["before"], seen["after"]
    assert before["ready_status"] == 200  # ready without it: the first request starts it
    assert before["ready_model"] == {"alive": 0, "ready": 0, "deferred": True}
    assert not before["ready_gauge"]  # no npugw_workers_ready sample: no "no ready worker" alert
    assert seen["status"] == 200 and seen["dim"] == 384, seen
    assert seen["health_during"] and set(seen["health_during"]) == {200}  # the loop served during the start
    assert after["ready_model"] == {"alive": 1, "ready": 1}
    assert after["ready_gauge"]
    assert before["max_model_len"] == after["max_model_len"] == 256  # the planned card is the engine's
    log = real_gateway.log()
    assert "all-MiniLM-L6-v2: its engine starts on first use" in log
    assert "all-MiniLM-L6-v2: engine started on first use in" in log
    print(f"embedding engine started on first use in {seen['seconds']:.1f}s; "
          f"{len(seen['health_during'])} /health answers meanwhile")


def test_models_list_both_models(client: openai.OpenAI) -> None:
    data = {m.id: m for m in client.models.list()}
    assert {EMBEDDED, EMBEDDING} <= set(data)
    assert data[EMBEDDED].max_model_len == 2048  # type: ignore[attr-defined]
    assert data[EMBEDDING].max_model_len == 256  # type: ignore[attr-defined]


def test_priority_field_is_accepted_by_the_engine(client: openai.OpenAI) -> None:
    # fcfs engines ignore it, priority engines order by it; it must never break a request
    r = chat(client, temperature=0, max_tokens=8, extra_body={"priority": 5, "unknown_future_field": True})
    assert "Paris" in text(r)
