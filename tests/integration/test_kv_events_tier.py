"""kv-events through a gateway tier: two real nodes (npu-gateway processes,
one engine each, started with vLLM's KV events on loopback TCP by
`--engine-arg kv_events_config=...`) behind a gateway-only front
(`--model none --upstream 'smol=URL,URL;kv-events=...;kv-tokenizer=FOLDER'
--routing-policy kv-events`). The front indexes both nodes' events; a
repeated prompt goes to the node that holds it (least outstanding would
take the other one: it alternates between idle nodes) and that node reports
the prompt's full blocks cached."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support import EMBEDDED, GatewayProcess, free_port, metric_value, wait_until_sync

from engine_adapter.model import prepare_embedded_model

pytestmark = pytest.mark.engine

NODE_ARGS = ["--embedding-model", "none", "--max-model-len", "2048", "--max-num-seqs", "4",
             "--readiness-interval", "3600", "--seed", "0"]


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list[str]]]:
    tmp = tmp_path_factory.mktemp("kv-tier")
    procs: list[GatewayProcess] = []
    pubs: list[str] = []
    try:
        for i in range(2):
            pub, replay = free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",  # vLLM binds only a wildcard TCP endpoint
                   "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
            procs.append(GatewayProcess([*NODE_ARGS, "--engine-arg", f"kv_events_config={json.dumps(cfg)}"],
                                        tmp / f"node{i}.log"))
            pubs.append(f"tcp://127.0.0.1:{pub}|tcp://127.0.0.1:{replay}")
        for p in procs:
            p.wait_ready(timeout=600)
        urls = [p.url for p in procs]
        spec = f"{EMBEDDED}={','.join(urls)};kv-events={','.join(pubs)};kv-tokenizer={prepare_embedded_model()}"
        front = GatewayProcess(["--model", "none", "--upstream", spec, "--routing-policy", "kv-events"],
                               tmp / "front.log")
        procs.append(front)
        front.wait_ready(timeout=120)
        yield front, urls
    finally:
        for p in procs:
            p.stop()


def value(text: str, name: str, **labels: str) -> float:
    try:
        return metric_value(text, name, **labels)
    except KeyError:
        return 0.0


MESSAGES = [
    {"role": "system", "content": " ".join(f"Rule {i}: keep to the facts, in plain words." for i in range(70))},
    {"role": "user", "content": "Hello."},
]


def test_the_front_routes_a_repeat_to_the_node_holding_it(tier: tuple[GatewayProcess, list[str]]) -> None:
    front, urls = tier
    chat: dict[str, Any] = {"model": EMBEDDED, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=front.url, timeout=300) as c:
        first = c.post("/v1/chat/completions", json=chat)
        assert first.status_code == 200, first.text
        n = first.json()["usage"]["prompt_tokens"]
        assert n >= 5 * 128
        full = n // 128 * 128 if n % 128 else n - 128

        def indexed() -> bool:
            text = c.get("/metrics").text
            return any(value(text, "npugw_kv_index_blocks", model=EMBEDDED, engine=u) >= full // 128 for u in urls)

        wait_until_sync(indexed, timeout=30, what=lambda: "the front's index of the serving node; its kv metrics: "
                        + " | ".join(ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("npugw_kv")))
        second = c.post("/v1/chat/completions", json=chat)
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full
        text = c.get("/metrics").text
        assert value(text, "npugw_route_policy_decisions_total", model=EMBEDDED, policy="kv-events",
                     reason="kv_hit") == 1
        # the node that served both is routed on its events; the other one has sent none yet
        assert sorted(value(text, "npugw_kv_index_healthy", model=EMBEDDED, engine=u) for u in urls) == [0, 1]
