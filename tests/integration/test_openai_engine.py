"""The real vLLM engine with the embedded SmolLM2, driven by the official
OpenAI SDK over a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
from support import EMBEDDED, GatewayProcess, metric_value, wait_until
from transformers import AutoTokenizer

from engine_adapter.model import embedded_model_dir

pytestmark = pytest.mark.engine
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(real_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert EMBEDDED in ids


def test_chat_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion"
    assert r.usage is not None and r.usage.completion_tokens > 0


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=EMBEDDED, messages=msgs, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=EMBEDDED, messages=msgs, temperature=0, max_tokens=40, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    parts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "".join(parts) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_usage_prompt_tokens_match_tokenizer(client: openai.OpenAI) -> None:
    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    text = tok.apply_chat_template(PARIS, tokenize=False, add_generation_prompt=True)
    expected = len(tok.encode(text, add_special_tokens=False))
    r = client.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=4)  # type: ignore[arg-type]
    assert r.usage is not None
    assert r.usage.prompt_tokens == expected
    assert r.usage.completion_tokens == 4
    assert r.choices[0].finish_reason == "length"


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=EMBEDDED, prompt=prompt, temperature=0, max_tokens=8)
    assert r.object == "text_completion"
    assert "Paris" in r.choices[0].text
    parts = [
        c.choices[0].text
        for c in client.completions.create(model=EMBEDDED, prompt=prompt, temperature=0, max_tokens=8, stream=True)
        if c.choices
    ]
    assert "".join(parts) == r.choices[0].text


def test_context_length_is_checked(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=EMBEDDED, messages=PARIS, max_tokens=5000)  # type: ignore[arg-type]
    err = e.value.body
    assert isinstance(err, dict)
    assert "2048" in err["message"] and "5000" in err["message"]
    assert err["param"] == "max_tokens"


def test_unknown_model_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=PARIS)  # type: ignore[arg-type]
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"


def _unfinished(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, "npugw_engine_unfinished_requests", model_name=EMBEDDED)


@pytest.mark.asyncio
async def test_disconnect_mid_stream_aborts_engine_request(real_gateway: GatewayProcess) -> None:
    body = {
        "model": EMBEDDED, "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 1500, "ignore_eos": True, "stream": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", real_gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            got = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got >= 3:
                    break
            assert _unfinished(real_gateway.url) >= 1  # still generating
    await wait_until(lambda: _unfinished(real_gateway.url) == 0, timeout=5, what="no unfinished engine request",
                     interval=0.1)


@pytest.mark.asyncio
async def test_queue_overflow_gives_429_with_retry_after(real_gateway: GatewayProcess) -> None:
    # 8 engine slots + 32 queue places: 60 at once must overflow.
    body = {"model": EMBEDDED, "prompt": "Count:", "max_tokens": 24, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=100)) as http:
        rs = await asyncio.gather(*(http.post(real_gateway.url + "/v1/completions", json=body) for _ in range(60)))
    codes = [r.status_code for r in rs]
    rejected = [r for r in rs if r.status_code == 429]
    assert codes.count(200) >= 40 and len(rejected) >= 10, codes
    assert set(codes) <= {200, 429}
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    assert _unfinished(real_gateway.url) == 0


@pytest.mark.asyncio
async def test_stream_overflow_gets_429_before_any_byte(real_gateway: GatewayProcess) -> None:
    """The same overload, streamed: a refused stream is a 429 status with
    Retry-After and a JSON body (no SSE byte); an admitted one streams to
    [DONE] with no error event."""
    body = {"model": EMBEDDED, "prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "stream": True}

    async def one(http: httpx.AsyncClient) -> tuple[httpx.Response, bytes]:
        async with http.stream("POST", real_gateway.url + "/v1/completions", json=body) as r:
            return r, await r.aread()

    async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=100)) as http:
        results = await asyncio.gather(*(one(http) for _ in range(60)))
    codes = [r.status_code for r, _ in results]
    assert codes.count(200) >= 40 and codes.count(429) >= 10 and set(codes) <= {200, 429}, codes
    for r, raw in results:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.headers["content-type"].startswith("application/json")
            assert not raw.startswith(b"data:") and orjson.loads(raw)["error"]["code"] == "queue_full"
        else:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert raw.endswith(b"data: [DONE]\n\n")
            # parsed, not grepped: the model's own text may hold a token "error"
            events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
            assert events and not any("error" in e for e in events), raw[-300:]
            assert events[-1]["choices"][0]["finish_reason"] == "length"  # all 24 tokens
    assert _unfinished(real_gateway.url) == 0
