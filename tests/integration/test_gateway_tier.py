"""A gateway tier in front of a real node: a gateway-only process started
with nothing but `--model none --upstream NAME=URL` (no tokenizer) in front of
the session's real gateway (vLLM, SmolLM2; it also serves an embedding
model, so its /v1/models lists two). `SmolLM2-135M-Instruct=URL` is found by
name among the node's models; `smol=URL;model=SmolLM2-135M-Instruct` serves
it under another name. Chat, streaming and completions come back as the
node answered them, under the client's name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support import EMBEDDED, GatewayProcess, metric_value

pytestmark = pytest.mark.engine
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tier(real_gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("tier")
    t0 = time.monotonic()
    front = GatewayProcess(["--model", "none", "--upstream", f"{EMBEDDED}={real_gateway.url}",
                            "--upstream", f"smol={real_gateway.url};model={EMBEDDED}"], tmp / "front.log")
    try:
        front.wait_ready(60)
        front.ready_after = time.monotonic() - t0  # type: ignore[attr-defined]
        print(f"gateway-only front ready after {front.ready_after:.2f} s")  # type: ignore[attr-defined]
        yield front
    finally:
        front.stop()


def test_the_front_learns_the_node_model_id_and_is_ready(tier: GatewayProcess) -> None:
    assert f"serves model '{EMBEDDED}'" in tier.log()
    ids = [m["id"] for m in httpx.get(tier.url + "/v1/models").json()["data"]]
    assert sorted(ids) == sorted([EMBEDDED, "smol"])
    assert httpx.get(tier.url + "/ready").status_code == 200


def test_chat_through_the_tier_equals_the_node(tier: GatewayProcess, real_gateway: GatewayProcess) -> None:
    via = openai.OpenAI(base_url=tier.url + "/v1", api_key="x", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        a = via.chat.completions.create(model="smol", messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
        b = direct.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
        assert a.model == "smol" and "Paris" in (a.choices[0].message.content or "")
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage is not None and b.usage is not None and a.usage.completion_tokens == b.usage.completion_tokens
        parts = []
        for chunk in via.chat.completions.create(model="smol", messages=PARIS, temperature=0, max_tokens=20,  # type: ignore[arg-type]
                                                 stream=True):
            assert chunk.model == "smol"
            parts.extend(c.delta.content or "" for c in chunk.choices)
        assert "".join(parts) == a.choices[0].message.content
        text = via.completions.create(model=EMBEDDED, prompt="The capital of France is", max_tokens=5, temperature=0)
        assert text.model == EMBEDDED and text.choices[0].text
        metrics = httpx.get(tier.url + "/metrics").text
        assert metric_value(metrics, "npugw_api_key_tokens_total", model_name="smol", type="completion") >= (
            a.usage.completion_tokens
        )
    finally:
        via.close()
        direct.close()


def test_node_refusals_keep_their_status_through_the_tier(tier: GatewayProcess) -> None:
    r = httpx.post(tier.url + "/v1/chat/completions", json={"model": "smol", "messages": PARIS, "max_tokens": 10**6})
    assert r.status_code == 400, r.text  # the node's own context-length refusal
    assert "context length" in r.json()["error"]["message"]


def test_the_other_apis_pass_through_the_tier(tier: GatewayProcess) -> None:
    """The node (an npu-gateway) publishes Responses, Messages and /generate
    in its /openapi.json: the front passes them through, under its own name."""
    import anthropic

    claude = anthropic.Anthropic(base_url=tier.url, api_key="x", max_retries=0, timeout=120)
    via = openai.OpenAI(base_url=tier.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        greedy: Any = {"temperature": 0}
        m = claude.messages.create(model="smol", max_tokens=20, messages=PARIS, extra_body=greedy)  # type: ignore[arg-type]
        assert m.model == "smol" and "Paris" in m.content[0].text  # type: ignore[union-attr]
        r = via.responses.create(model="smol", input=PARIS[0]["content"], temperature=0, max_output_tokens=20)
        assert r.model == "smol" and r.output_text == m.content[0].text  # type: ignore[union-attr]
        g = httpx.post(tier.url + "/generate", json={"model": "smol", "inputs": "The capital of France is",
                                                     "parameters": {"max_new_tokens": 5, "details": True}}, timeout=120)
        assert g.status_code == 200 and g.json()["details"]["generated_tokens"] >= 1
        metrics = httpx.get(tier.url + "/metrics").text
        assert metric_value(metrics, "npugw_api_key_tokens_total", model_name="smol", type="completion") >= (
            m.usage.output_tokens + (r.usage.output_tokens if r.usage else 0)
        )
        assert "client APIs: count_tokens, generate, messages, responses, tgi" in tier.log()
    finally:
        claude.close()
        via.close()
