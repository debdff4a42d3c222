"""The prefix routing policy on two real vLLM engines: one gateway process
with `--num-workers 2 --routing-policy prefix` (prefix caching on, vLLM's
default). Two tenants, each with its own ~650-token system prompt, are
first placed on different engines (B arrives while A's stream holds A's
engine); then their conversations continue one request at a time, which
least outstanding would send to engine 0 every time (both idle, the first
of equals). With the prefix policy each tenant's requests stay on its own
engine, both engines' `vllm:prefix_cache_hits` rise with them, and the
decisions are counted as prefix hits.

Through a gateway tier: a gateway-only front (`--model none --upstream
smol=URL,URL --routing-policy prefix`, no tokenizer: it keys the request's
text) over two real nodes, this module's gateway and the session's real
gateway. Each tenant's requests stay on one node and that node's
`vllm:prefix_cache_hits` rise. A simulated-backend tier is in
tests/engine_adapter/test_routing_policy.py; the real two-node comparison
is bench/prefix_routing.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support import EMBEDDED, GatewayProcess, metric_value, wait_until

pytestmark = pytest.mark.engine

ARGS = [
    "--num-workers", "2",
    "--routing-policy", "prefix",
    "--embedding-model", "none",
    "--max-model-len", "2048",
    "--max-num-seqs", "4",
    "--readiness-interval", "3600",
    "--seed", "0",
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("prefix-routing")
    gw = GatewayProcess(ARGS, tmp / "gateway.log")
    try:
        gw.wait_ready(timeout=600)
        yield gw
    finally:
        gw.stop()


def system_prompt(tenant: str) -> str:
    return " ".join(f"Rule {i} of {tenant}: answer briefly, politely and in plain words." for i in range(50))


def body(tenant: str, turn: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": EMBEDDED, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "messages": [{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": turn}],
    }


def held_stream(tenant: str) -> dict[str, Any]:
    """A stream that holds its engine for a few seconds after its first
    chunk (256 tokens, no early end), so that a request sent after that
    chunk meets it in flight even on a slow, busy box."""
    return {**body(tenant, "Hello.", 256, True), "ignore_eos": True}


def per_engine(text: str, name: str) -> dict[str, float]:
    return {e: metric_value(text, name, model_name=EMBEDDED, engine=e) for e in ("0", "1")}


async def finished_after(c: httpx.AsyncClient, base: str, n: int) -> str:
    """/metrics once the engines counted `n` more finished requests than in
    `base` (their stats land just after the answers); fails after 60 s."""
    was = sum(per_engine(base, "vllm:request_success_total").values())

    async def poll() -> str:
        while True:
            text = (await c.get("/metrics")).text
            if sum(per_engine(text, "vllm:request_success_total").values()) >= was + n:
                return text
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), 60)


def decisions(text: str, reason: str) -> float:
    try:
        return metric_value(text, "npugw_route_policy_decisions_total", model=EMBEDDED, policy="prefix",
                            reason=reason)
    except KeyError:  # none yet
        return 0.0


@pytest.mark.asyncio
async def test_a_shared_prefix_stays_on_its_engine_and_hits_its_cache(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=300) as c:
        start = (await c.get("/metrics")).text
        # A's stream holds one engine while B is admitted: B goes to the other
        async with c.stream("POST", "/v1/chat/completions", json=held_stream("tenant A")) as a:
            assert a.status_code == 200
            lines = a.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            r = await c.post("/v1/chat/completions", json=body("tenant B", "Hello.", 4))
            assert r.status_code == 200, r.text
            async for _ in lines:
                pass

        before = await finished_after(c, start, 2)
        assert decisions(before, "no_match") - decisions(start, "no_match") == 2
        placed = per_engine(before, "vllm:request_success_total")
        start_done = per_engine(start, "vllm:request_success_total")
        assert sorted(placed[e] - start_done[e] for e in placed) == [1, 1]  # one tenant per engine

        # the conversations go on, one request at a time
        turns = ["What is 2 + 2?", "Name a colour.", "Say yes.", "Count to three."]
        for i, turn in enumerate(turns):
            tenant = "tenant A" if i % 2 == 0 else "tenant B"
            r = await c.post("/v1/chat/completions", json=body(tenant, turn, 4))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 600
        after = await finished_after(c, before, len(turns))

    served = {e: per_engine(after, "vllm:request_success_total")[e] - placed[e] for e in placed}
    assert served == {"0": 2, "1": 2}  # least outstanding: {"0": 4, "1": 0}
    hits = {e: per_engine(after, "vllm:prefix_cache_hits_total")[e]
            - per_engine(before, "vllm:prefix_cache_hits_total")[e] for e in placed}
    queries = {e: per_engine(after, "vllm:prefix_cache_queries_total")[e]
               - per_engine(before, "vllm:prefix_cache_queries_total")[e] for e in placed}
    for e in placed:  # each engine served its tenant's system prompt from its cache, twice
        assert hits[e] >= 2 * 256 and hits[e] >= 0.5 * queries[e], (hits, queries)
    assert decisions(after, "prefix_hit") - decisions(before, "prefix_hit") == len(turns)
    matched = metric_value(after, "npugw_route_prefix_match_length_sum", model=EMBEDDED, unit="tokens") - (
        metric_value(before, "npugw_route_prefix_match_length_sum", model=EMBEDDED, unit="tokens"))
    assert matched >= len(turns) * 576  # whole 64-token blocks of the shared system prompt


@pytest.mark.asyncio
async def test_a_full_engine_spills_to_the_other(gateway: GatewayProcess) -> None:
    """A tenant's burst past its engine's slots (--max-num-seqs 4) is served
    by the other engine, not queued behind its own. Four long streams hold
    the tenant's engine (admitted, so their slots are taken, before their
    first byte); the burst's two requests then go to the other engine."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=300) as c:
        tenant = "tenant C"
        start = (await c.get("/metrics")).text
        first = await c.post("/v1/chat/completions", json=body(tenant, "Hello.", 2))
        assert first.status_code == 200
        before = await finished_after(c, start, 1)
        placed = per_engine(before, "vllm:request_success_total")
        longs = [c.build_request("POST", "/v1/chat/completions",
                                 json={**body(tenant, f"Tell story {i}.", 1024, True), "ignore_eos": True})
                 for i in range(4)]
        held = await asyncio.gather(*(c.send(r, stream=True) for r in longs))  # opened together
        try:
            assert [s.status_code for s in held] == [200] * 4
            mid = (await c.get("/metrics")).text
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body(tenant, f"Question {i}?", 4))
                                        for i in range(2)))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            after = await finished_after(c, before, 2)
        finally:
            for s in held:  # leaving the streams aborts them on their engine
                await s.aclose()
    home = max(placed, key=lambda e: placed[e] - per_engine(start, "vllm:request_success_total")[e])
    other = "1" if home == "0" else "0"
    served = {e: per_engine(after, "vllm:request_success_total")[e] - placed[e] for e in placed}
    assert served[other] == 2, (home, served)  # the burst on the engine the streams left free
    assert decisions(mid, "prefix_hit") - decisions(before, "prefix_hit") == 4  # the streams: on the tenant's engine


def node_total(text: str, name: str) -> float:
    return metric_value(text, name, model_name=EMBEDDED)  # over a node's engines


@pytest.mark.asyncio
async def test_a_tier_keeps_each_tenant_on_its_node(
    gateway: GatewayProcess, real_gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    nodes = [gateway, real_gateway]  # URL 0 and URL 1 of the upstream
    front = GatewayProcess(["--model", "none", "--upstream", f"smol={gateway.url},{real_gateway.url};model={EMBEDDED}",
                            "--routing-policy", "prefix"], tmp_path_factory.mktemp("prefix-tier") / "front.log")
    try:
        front.wait_ready(60)
        async with httpx.AsyncClient(timeout=300) as c:
            async def scrape() -> list[str]:
                return [(await c.get(n.url + "/metrics")).text for n in nodes]

            async def finished(base: list[str], n: int) -> list[str]:
                want = sum(node_total(t, "vllm:request_success_total") for t in base) + n
                texts: list[str] = []

                async def counted() -> bool:
                    nonlocal texts
                    texts = await scrape()
                    return sum(node_total(t, "vllm:request_success_total") for t in texts) >= want

                await wait_until(counted, timeout=60, what="the nodes' engines to count the requests", interval=0.05)
                return texts

            def tier_body(tenant: str, turn: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
                return {**body(tenant, turn, max_tokens, stream), "model": "smol"}

            start = await scrape()
            # D's stream holds node 0 while E arrives: E goes to node 1
            async with c.stream("POST", front.url + "/v1/chat/completions",
                                json={**held_stream("tenant D"), "model": "smol"}) as d:
                assert d.status_code == 200
                lines = d.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                r = await c.post(front.url + "/v1/chat/completions", json=tier_body("tenant E", "Hello.", 4))
                assert r.status_code == 200, r.text
                async for _ in lines:
                    pass
            placed = await finished(start, 2)
            turns = ["What is 2 + 2?", "Name a colour.", "Say yes.", "Count to three."]
            for i, turn in enumerate(turns):
                r = await c.post(front.url + "/v1/chat/completions",
                                 json=tier_body("tenant D" if i % 2 == 0 else "tenant E", turn, 4))
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "smol"
            after = await finished(placed, len(turns))
            decided = (await c.get(front.url + "/metrics")).text
    finally:
        front.stop()

    def delta(name: str, a: list[str], b: list[str]) -> list[float]:
        return [node_total(y, name) - node_total(x, name) for x, y in zip(a, b, strict=True)]

    assert delta("vllm:request_success_total", start, after) == [3, 3]  # least outstanding: [5, 1]
    hits = delta("vllm:prefix_cache_hits_total", placed, after)
    for node_hits in hits:  # each node served its tenant's system prompt from its cache, twice
        assert node_hits >= 2 * 256, hits
    assert metric_value(decided, "npugw_route_policy_decisions_total", model="smol", policy="prefix",
                        reason="prefix_hit") == len(turns)
    assert metric_value(decided, "npugw_route_policy_decisions_total", model="smol", policy="prefix",
                        reason="no_match") == 2
