"""One streamed chunk per engine step that made a token, as vLLM's server
sends them: a step whose text the detokenizer holds back (the first bytes of
a multi-byte character) still gets its chunk, with empty text. Clients that
time or count chunks (`vllm bench serve`, token-rate meters) then see every
step when it happens, not two steps' text at once a step late."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from sim_app import serve

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, GenerationRequest

# (text, token ids) per engine step: "é" is two byte-level tokens, the first held back
STEPS: list[tuple[str, tuple[int, ...]]] = [("Caf", (101,)), ("", (102,)), ("é", (103,)), (" ok", (104,))]


class SplitCharEngine(SimulatedEngine):
    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        for i, (text, ids) in enumerate(STEPS):
            last = i == len(STEPS) - 1
            yield EngineOutput(
                request_id=req.request_id, index=0, text=text, token_ids=ids,
                finish_reason="length" if last else None, prompt_tokens=len(req.prompt_token_ids),
            )


def pools() -> list[tuple[WorkerPool, tuple[str, ...], str]]:
    cfg = SimulatedConfig(max_model_len=256)
    return [(WorkerPool("sim", lambda i: SplitCharEngine(cfg, name="sim")), ("sim",), "sim")]


def events(raw: str) -> list[dict[str, object]]:
    parts = [e for e in raw.split("\n\n") if e]
    assert parts[-1] == "data: [DONE]"
    return [orjson.loads(e[6:]) for e in parts[:-1]]


@pytest.mark.asyncio
async def test_chat_stream_has_a_chunk_for_each_token_step() -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with serve(pools()) as (client, _):
        r = await client.post("/v1/chat/completions", json=body)
        plain = (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    assert r.status_code == 200, r.text
    deltas = [c["choices"][0]["delta"] for c in events(r.text)]  # type: ignore[index]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d.get("content") for d in deltas[1:]] == [t for t, _ in STEPS]
    assert plain["choices"][0]["message"]["content"] == "Café ok"


@pytest.mark.asyncio
async def test_completions_stream_has_a_chunk_for_each_token_step() -> None:
    body = {"model": "sim", "prompt": "hi", "max_tokens": 4, "stream": True}
    async with serve(pools()) as (client, _):
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = events(r.text)
    assert [c["choices"][0]["text"] for c in chunks] == [t for t, _ in STEPS]  # type: ignore[index]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
