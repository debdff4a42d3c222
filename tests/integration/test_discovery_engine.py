"""A gateway-only front in front of a real default node (`npu-gateway
serve` with no flags but limits: SmolLM2 and the embedding model; the
session's real gateway, whose engines are already up), with no extra flags:
`--upstream URL` serves both models under the node's ids, and `--upstream
remote=URL` sends chat to the generator and /v1/embeddings to the embedding
model (the node's cards say which is which). A model added to a node (a
restart with `--extra-model`) is picked up; while the node is down, a
refusal names the cause: that test stops and restarts its node, so it has
its own node and front; that node runs the simulated engine under the
embedded model's id (what the test checks is the front's discovery, and a
real engine's two starts took ~2 minutes of the suite; the real node's
answers are the other tests')."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support import EMBEDDED, EMBEDDING, GatewayProcess, wait_until_sync

pytestmark = pytest.mark.engine
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
NODE_ARGS = ["--backend", "simulated", "--served-model-name", EMBEDDED, "--readiness-interval", "3600",
             "--embedding-model", "none"]
FRONT_ARGS = ["--model", "none", "--upstream-health-interval", "0.5"]


def node_on(port: int | None, extra: list[str], log: Path) -> GatewayProcess:
    """A node on the simulated engine; on `port` when given (a restart at the same URL)."""
    node = GatewayProcess([*NODE_ARGS, *extra, *(["--port", str(port)] if port else [])], log)
    if port:  # argparse keeps the last --port
        node.port, node.url = port, f"http://127.0.0.1:{port}"
    return node


def front_of(node: GatewayProcess, log: Path) -> GatewayProcess:
    front = GatewayProcess([*FRONT_ARGS, "--upstream", node.url, "--upstream", f"remote={node.url}"], log)
    try:
        front.wait_ready(60)
    except BaseException:
        front.stop()
        raise
    return front


@pytest.fixture(scope="module")
def tier(real_gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GatewayProcess]]:
    front = front_of(real_gateway, tmp_path_factory.mktemp("discovery") / "front.log")
    try:
        yield {"node": real_gateway, "front": front}
    finally:
        front.stop()


@pytest.fixture
def own_tier(tmp_path: Path) -> Iterator[dict[str, GatewayProcess]]:
    """A node of this test's own (it is stopped and restarted) and its front."""
    procs = {"node": node_on(None, [], tmp_path / "node.log")}
    try:
        procs["node"].wait_ready(90)
        procs["front"] = front_of(procs["node"], tmp_path / "front.log")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def models_of(url: str) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def test_the_front_serves_every_model_of_the_node_under_its_ids(tier: dict[str, GatewayProcess]) -> None:
    listed = models_of(tier["front"].url)
    assert sorted(listed) == sorted([EMBEDDED, EMBEDDING, "remote"])
    assert listed[EMBEDDING]["kind"] == "embed" and listed[EMBEDDED]["kind"] == "generate"
    assert listed[EMBEDDING]["max_model_len"] == models_of(tier["node"].url)[EMBEDDING]["max_model_len"]
    log = tier["front"].log()
    assert f"lists model '{EMBEDDED}': routable" in log and f"lists model '{EMBEDDING}': routable" in log
    assert f"serves model '{EMBEDDED}' (embeddings: '{EMBEDDING}')" in log  # remote=URL


def test_chat_stream_and_embeddings_by_discovery_equal_the_node(tier: dict[str, GatewayProcess]) -> None:
    via = openai.OpenAI(base_url=tier["front"].url + "/v1", api_key="x", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=tier["node"].url + "/v1", api_key="x", max_retries=0, timeout=120)
    a = via.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    b = direct.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    assert a.model == EMBEDDED and a.choices[0].message.content
    assert a.choices[0].message.content == b.choices[0].message.content  # greedy: the node's own answer
    parts = []
    for chunk in via.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=20,  # type: ignore[arg-type]
                                             stream=True):
        assert chunk.model == EMBEDDED
        parts.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(parts) == a.choices[0].message.content
    e = via.embeddings.create(model=EMBEDDING, input=["A cat sits on the mat."])
    f = direct.embeddings.create(model=EMBEDDING, input=["A cat sits on the mat."])
    assert e.model == EMBEDDING and len(e.data[0].embedding) == 384
    assert e.data[0].embedding == pytest.approx(f.data[0].embedding, abs=1e-5)


def test_a_named_upstream_sends_each_api_to_the_model_that_serves_it(tier: dict[str, GatewayProcess]) -> None:
    via = openai.OpenAI(base_url=tier["front"].url + "/v1", api_key="x", max_retries=0, timeout=120)
    chat = via.chat.completions.create(model="remote", messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    direct = openai.OpenAI(base_url=tier["node"].url + "/v1", api_key="x", max_retries=0, timeout=120)
    same = direct.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    assert chat.model == "remote" and chat.choices[0].message.content == same.choices[0].message.content
    emb = via.embeddings.create(model="remote", input=["A cat sits on the mat."])
    assert emb.model == "remote" and len(emb.data[0].embedding) == 384  # all-MiniLM-L6-v2's, not a 400


def test_a_model_added_to_the_node_is_picked_up_and_a_down_node_is_named(
    own_tier: dict[str, GatewayProcess], tmp_path: Path
) -> None:
    """Stops its node, then restarts it with one more model."""
    tier = own_tier
    node, front = tier["node"], tier["front"]
    port = node.port
    node.stop()
    r = None

    def refused() -> bool:
        nonlocal r
        r = httpx.post(front.url + "/v1/chat/completions", json={"model": EMBEDDED, "messages": PARIS}, timeout=30)
        return r.status_code == 503 and "every URL is ejected" in r.text  # once the health checks ejected it

    wait_until_sync(refused, timeout=30, what="the front to refuse while the node is down")
    assert r is not None
    message = r.json()["error"]["message"]
    assert f"every URL is ejected: {node.url}: " in message and "onnect" in message, message  # the cause
    assert EMBEDDED in models_of(front.url)  # down is a 503, not a 404: the model stays listed
    t0 = time.monotonic()
    tier["node"] = node_on(port, ["--extra-model", "smol-b=embedded"], tmp_path / "node2.log")
    tier["node"].wait_ready(90)
    wait_until_sync(lambda: "smol-b" in models_of(front.url), timeout=30, what="the new model on the front")

    def answers() -> bool:  # the refusals above opened the URL's breaker: it closes after its cooldown (10 s)
        body = {"model": "smol-b", "messages": PARIS, "max_tokens": 5}
        return httpx.post(front.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200

    wait_until_sync(answers, timeout=40, what="the front to serve the new model")
    print(f"node restarted with one more model, picked up after {time.monotonic() - t0:.1f} s")
    via = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120)
    answer = via.chat.completions.create(model="smol-b", messages=PARIS, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    assert answer.model == "smol-b" and answer.choices[0].message.content
    assert "lists model 'smol-b': routable" in front.log()
    assert via.chat.completions.create(model=EMBEDDED, messages=PARIS, max_tokens=5).choices  # type: ignore[arg-type]
