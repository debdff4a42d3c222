"""Routing policies (engine_adapter/routing/policy.py): the prefix map
(insert and match, eviction under its bound, the load fallback threshold, a
dead engine's removal), sessions, keys from token ids and from a relayed
body; then the policies at work in a WorkerPool, in an Upstream's choice of
URL, and through a gateway tier in front of two recording nodes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeNode, tier
from sim_app import serve
from support import metric_value, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineDead
from engine_adapter.lease import Prepared
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.policies import make_policy
from engine_adapter.routing.policy import (
    PolicyOptions,
    PrefixPolicy,
    RouteKey,
    RoutingPolicy,
    SessionPolicy,
    parse_policies,
)
from engine_adapter.routing.upstream import Endpoint, Upstream, UpstreamConfig, parse_upstream
from engine_adapter.types import GenerationRequest, SamplingOptions

SYSTEM = tuple(range(1000, 1600))  # a 600-token shared prefix


def prompt(tail: int, head: tuple[int, ...] = SYSTEM) -> tuple[int, ...]:
    return (*head, *range(tail * 100, tail * 100 + 30))


def choose(p: RoutingPolicy, ids: tuple[int, ...], loads: list[int], session: str | None = None) -> int:
    engines = list(range(len(loads)))
    return engines[p.choose(engines, loads, p.key_for_tokens(ids, session))]


# ---- the prefix map ------------------------------------------------------
def test_insert_and_match_the_longest_prefix() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
    assert choose(p, prompt(1), [3, 0]) == 1  # nothing known: least outstanding
    assert p.stats.decisions["no_match"] == 1
    # the same system prompt, another user turn: engine 1 again, though busier
    assert choose(p, prompt(2), [0, 3]) == 1
    assert p.stats.decisions["prefix_hit"] == 1
    assert p.stats.match_sum == len(SYSTEM) // 16 * 16  # whole blocks of the shared 600 tokens
    # a different system prompt goes by load, and is remembered where it went
    other = tuple(range(5000, 5600))
    assert choose(p, prompt(3, other), [0, 3]) == 0
    assert choose(p, prompt(4, other), [2, 0]) == 0
    assert choose(p, prompt(5), [0, 2]) == 1
    # the longest match wins among several: a conversation continued
    convo = prompt(6)
    assert choose(p, convo, [0, 0]) == 1
    longer = (*convo, *range(9000, 9100))
    assert choose(p, longer, [0, 5]) == 1
    assert p.stats.match_sum >= 2 * 592 + len(convo) // 16 * 16


def test_a_prompt_shorter_than_a_block_has_no_key_to_match() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
    assert p.key_for_tokens(tuple(range(15)), None).blocks == ()
    assert choose(p, tuple(range(15)), [1, 0]) == 1
    assert choose(p, tuple(range(15)), [0, 1]) == 0
    assert p.stats.decisions["no_match"] == 2 and len(p) == 0


def test_routing_blocks_are_whole_kv_blocks_of_at_least_64_tokens() -> None:
    for kv, grain in ((16, 64), (32, 64), (48, 96), (128, 128)):
        p = PrefixPolicy(block_tokens=kv)
        key = p.key_for_tokens(tuple(range(1000)), None)
        assert (p.route_tokens, key.unit, len(key.blocks)) == (grain, grain, 1000 // grain)
        assert p.key_for_tokens(list(range(1000)), None) == key  # a list keys as its tuple
    p = PrefixPolicy()  # 16-token KV blocks by default, routed in 64-token blocks
    assert choose(p, prompt(1), [0, 1]) == 0
    assert choose(p, prompt(2), [1, 0]) == 0
    assert p.stats.match_sum == len(SYSTEM) // 64 * 64  # 576 of the shared 600 tokens
    # 100 shared tokens are one routing block: a match of 64 tokens
    head = tuple(range(7000, 7100))
    assert choose(p, (*head, *range(1, 40)), [0, 1]) == 0
    assert choose(p, (*head, *range(50, 90)), [1, 0]) == 0
    assert p.stats.match_sum == 576 + 64 and p.stats.decisions["prefix_hit"] == 2


def test_eviction_keeps_the_map_under_its_bound_and_the_shared_head_longest() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16, max_blocks=100)
    for i in range(50):  # 50 prompts of 39 blocks each, 37 of them shared
        assert choose(p, prompt(i), [i % 2, 0]) == 0  # the first went to 0, the rest follow
        assert len(p) <= 100
    # the shared head was touched last each time: it is still there, whole
    hits = p.stats.match_count
    assert choose(p, prompt(99), [5, 0]) == 0
    assert p.stats.decisions["prefix_hit"] == 50 and p.stats.match_count == hits + 1
    assert p.stats.match_sum >= 50 * 37 * 16
    # a prompt seen long ago, with nothing shared, was evicted
    q = PrefixPolicy(block_tokens=16, min_block_tokens=16, max_blocks=40)
    first = tuple(range(640))
    choose(q, first, [0, 1])  # on engine 0
    for i in range(10):
        choose(q, tuple(range(10000 * (i + 1), 10000 * (i + 1) + 640)), [1, 0])
    assert len(q) <= 40
    assert choose(q, first, [1, 0]) == 1  # forgotten: least outstanding
    assert q.stats.decisions["no_match"] >= 1


def test_the_load_fallback_needs_both_thresholds() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16, balance_abs=4, balance_rel=2.0)
    assert choose(p, prompt(1), [0, 1]) == 0  # engine 0 has the prefix now
    assert choose(p, prompt(2), [4, 0]) == 0  # 4 above: not more than abs
    assert choose(p, prompt(3), [5, 0]) == 1  # 5 above and > 2x: least outstanding
    assert p.stats.decisions["load_fallback"] == 1
    # the fallback engine saw the prompt too: both match now
    assert choose(p, prompt(4), [20, 12]) == 1  # both hold it: the less loaded
    r = PrefixPolicy(block_tokens=16, min_block_tokens=16, balance_abs=4, balance_rel=2.0)
    assert choose(r, prompt(1), [0, 1]) == 0
    assert choose(r, prompt(2), [20, 12]) == 0  # 8 above but not 2x: stays
    assert r.stats.decisions["load_fallback"] == 0


def test_a_match_on_a_full_engine_falls_back_while_another_has_room() -> None:
    engines = [0, 1]

    def homed() -> tuple[PrefixPolicy, RouteKey]:  # thresholds 16 and 1.5: never reached here
        p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
        key = p.key_for_tokens(prompt(1), None)
        assert p.choose(engines, [0, 1], key, slots=[4, 4]) == 0  # engine 0 has the prefix now
        return p, key

    p, key = homed()
    assert p.choose(engines, [3, 0], key, slots=[4, 4]) == 0  # a free slot left: the match wins
    assert p.choose(engines, [4, 0], key) == 0  # slots unknown: only the thresholds count
    assert p.choose(engines, [4, 3], key, slots=[0, 4]) == 0  # its own slots unknown: never full
    assert p.choose(engines, [6, 4], key, slots=[4, 4]) == 0  # all full: it waits where its prefix is
    assert p.stats.decisions["load_fallback"] == 0
    assert p.choose(engines, [4, 3], key, slots=[4, 4]) == 1  # full, the other has room: least outstanding
    assert p.stats.decisions["load_fallback"] == 1
    p, key = homed()
    assert p.choose(engines, [4, 3], key, slots=[4, 0]) == 1  # the other's slots unknown: it has room
    assert p.stats.decisions["load_fallback"] == 1
    # least-outstanding and session ignore slots
    assert RoutingPolicy().choose(engines, [4, 3], None, slots=[4, 4]) == 1
    s = SessionPolicy()
    home = s.choose(engines, [0, 0], s.key_for_tokens(prompt(1), "alice"), slots=[4, 4])
    full = [4, 4]
    full[1 - home] = 0
    assert s.choose(engines, full, s.key_for_tokens(prompt(1), "alice"), slots=[4, 4]) == home


def test_a_dead_engine_loses_its_entries() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
    assert choose(p, prompt(1), [0, 1]) == 0
    other = tuple(range(5000, 5600))
    assert choose(p, prompt(2, other), [1, 0]) == 1
    before = len(p)
    p.forget(0)
    assert len(p) == before - len(prompt(1)) // 16
    assert choose(p, prompt(3), [0, 1]) == 0  # no match: least outstanding
    assert p.stats.decisions["no_match"] == 3
    assert choose(p, prompt(4, other), [0, 3]) == 1  # engine 1 kept its own
    # an engine that is not a candidate (dead, full) never matches
    engines = [0]
    assert p.choose(engines, [0], p.key_for_tokens(prompt(5, other), None)) == 0


def test_a_session_takes_precedence_and_stays_put() -> None:
    p = PrefixPolicy(block_tokens=16, min_block_tokens=16)
    assert choose(p, prompt(1), [0, 1]) == 0
    picks = {choose(p, prompt(i), [0, 0, 0, 0], session="alice") for i in range(5)}
    assert len(picks) == 1 and p.stats.decisions["session"] == 5
    home = picks.pop()
    # its home gone from the candidates, the session moves; back, it returns
    others = [e for e in range(4) if e != home]
    moved = others[p.choose(others, [0, 0, 0], p.key_for_tokens(prompt(9), "alice"))]
    assert moved != home
    assert choose(p, prompt(9), [9, 9, 9, 9], session="alice") == home
    s = SessionPolicy()
    spread = {choose(s, prompt(1), [0, 0, 0, 0], session=f"user-{i}") for i in range(40)}
    assert len(spread) == 4
    assert choose(s, prompt(1), [2, 0, 1, 3]) == 1  # no session: least outstanding


def test_relayed_bodies_match_on_their_prompt_text() -> None:
    p = PrefixPolicy(block_bytes=64)
    system = {"role": "system", "content": "You are a careful assistant. " * 40}

    def body(user: str, model: str = "m", **kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": [system, {"role": "user", "content": user}], **kw}

    a = p.key_for_body(body("What is the capital of France?"), None)
    b = p.key_for_body(body("And of Spain?", model="other", temperature=0.2, max_tokens=9), None)
    shared = 0
    for x, y in zip(a.blocks, b.blocks, strict=False):
        if x != y:
            break
        shared += 1
    assert shared >= 1200 // 64 and a.unit == 64
    assert p.key_for_body({"model": "m", "prompt": "x" * 200}, "s").blocks
    assert p.key_for_body({"model": "m", "prompt": "x" * 200}, "s").session == "s"


def test_policies_from_settings_items() -> None:
    assert parse_policies([]) == ("least-outstanding", {})
    assert parse_policies(["prefix", "chat=session", "a=b=least-outstanding"]) == (
        "prefix", {"chat": "session", "a=b": "least-outstanding"})
    with pytest.raises(ValueError, match="expected"):
        parse_policies(["prefixes"])
    p = make_policy("prefix", PolicyOptions(block_tokens=32, max_blocks=7, balance_abs=2, balance_rel=1.2))
    assert isinstance(p, PrefixPolicy) and (p.block_tokens, p.max_blocks, p.balance_abs) == (32, 7, 2)
    assert type(make_policy("least-outstanding")) is RoutingPolicy


# ---- in a WorkerPool -------------------------------------------------------
def gen(rid: str, ids: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=ids, sampling=SamplingOptions(max_tokens=2))


@pytest.mark.asyncio
async def test_a_pool_sends_a_shared_prefix_to_one_worker_until_it_dies() -> None:
    pool = WorkerPool("m", lambda i: SimulatedEngine(SimulatedConfig()), num_workers=2, readiness_interval=60,
                      restart_backoff=(0.01, 0.01))
    pool.policy = PrefixPolicy()  # the default grain: 64-token routing blocks
    await pool.start()
    leases = [await pool.acquire(Prepared([gen(f"r{i}", prompt(i))])) for i in range(4)]
    busy = [w.in_flight for w in pool.workers]
    assert sorted(busy) == [0, 4]  # least outstanding would have spread them 2 and 2
    home = pool.workers[busy.index(4)]
    for lease in leases:
        lease.release()
    assert pool.policy.stats.decisions["prefix_hit"] == 3
    pool._on_dead(home, EngineDead("test"))
    other = await pool.acquire(Prepared([gen("after", prompt(9))]))
    assert [w.in_flight for w in pool.workers if w is not home] == [1]
    other.release()
    await wait_until(lambda: home.alive, what="the worker restarted")
    # the restarted worker starts cold: the prefix stays where it went since
    loads = [0 if w is home else 3 for w in pool.workers]
    assert choose(pool.policy, prompt(10), loads) != home.index
    await pool.stop()


@pytest.mark.asyncio
async def test_the_default_pool_policy_is_least_outstanding() -> None:
    pool = WorkerPool("m", lambda i: SimulatedEngine(SimulatedConfig()), num_workers=2, readiness_interval=60)
    await pool.start()
    leases = [await pool.acquire(Prepared([gen(f"r{i}", prompt(i))]), session="s") for i in range(4)]
    assert [w.in_flight for w in pool.workers] == [2, 2]
    for lease in leases:
        lease.release()
    assert pool.policy.stats.decisions["least_outstanding"] == 4
    await pool.stop()


# ---- an Upstream's choice of URL --------------------------------------------
@pytest.mark.asyncio
async def test_upstream_pick_follows_the_prefix_and_an_ejected_url_forgets() -> None:
    up = Upstream(UpstreamConfig(name="r", urls=("http://a", "http://b"), eject_after=1))
    up.endpoints = [Endpoint("http://a"), Endpoint("http://b")]
    up.policy = PrefixPolicy(block_bytes=32)
    body = {"model": "r", "messages": [{"role": "system", "content": "long shared instructions " * 20}]}
    key = up.policy.key_for_body(body, None)
    first = up.pick(key=key)
    first.outstanding += 3
    assert up.pick(key=key) is first
    assert up.pick(exclude=[first], key=key) is not first  # a retry goes elsewhere
    up.failed(first, "boom")  # ejected: its entries go
    second = up.pick(key=key)
    assert second is not first
    up.succeeded(first)
    first.state, first.outstanding = "closed", 0
    assert up.pick(key=key) is second  # the new home, though busier now
    assert up.policy.stats.decisions["prefix_hit"] >= 2


@pytest.mark.asyncio
async def test_upstream_slots_move_a_match_off_a_full_url() -> None:
    assert parse_upstream("r=http://a,http://b;slots=8").slots == 8
    assert parse_upstream("r=http://a").slots is None
    with pytest.raises(ValueError, match="slots must be >= 1"):
        parse_upstream("r=http://a;slots=0")
    with pytest.raises(ValueError, match="not a number"):
        parse_upstream("r=http://a;slots=many")
    up = Upstream(parse_upstream("r=http://a,http://b;slots=2"))
    up.endpoints = [Endpoint("http://a"), Endpoint("http://b")]
    up.policy = PrefixPolicy(block_bytes=32)
    body = {"model": "r", "messages": [{"role": "system", "content": "long shared instructions " * 20}]}
    key = up.policy.key_for_body(body, None)
    home = up.pick(key=key)
    other = up.endpoints[1 - up.endpoints.index(home)]
    home.outstanding = 1
    assert up.pick(key=key) is home  # one slot left
    home.outstanding = 2
    assert up.pick(key=key) is other  # full: the other URL has room
    assert up.policy.stats.decisions["load_fallback"] == 1
    other.outstanding = 2
    assert up.pick(key=key) in (home, other)  # both full: both hold the prefix now


@pytest.mark.asyncio
async def test_a_tier_learns_each_nodes_slots_from_its_model_card() -> None:
    a, b = await FakeNode().start(), await FakeNode().start()
    a.slots = b.slots = 2  # what npu-gateway nodes say in /v1/models
    try:
        async with serve(None, tier(f"remote={a.url},{b.url}", routing_policy=["prefix"])) as (client, app):
            up = app.state.gateway.pools[0].workers[0].engine.upstream
            await wait_until(lambda: [ep.slots for ep in up.endpoints] == [2, 2], what="the nodes' cards read")
            system = {"role": "system", "content": "You answer in French. " * 120}

            def body(i: int) -> dict[str, Any]:
                return {"model": "remote", "max_tokens": 5,
                        "messages": [system, {"role": "user", "content": f"question {i}"}]}

            assert (await client.post("/v1/chat/completions", json=body(0))).status_code == 200
            home, other = (a, b) if a.calls else (b, a)
            home.delay = 0.2  # two streams at once fill it
            streams = [asyncio.create_task(client.post("/v1/chat/completions", json={**body(i), "stream": True}))
                       for i in (1, 2)]
            await wait_until(lambda: len(home.calls) == 3, what="two streams on the prefix's node")
            r = await client.post("/v1/chat/completions", json=body(3))
            assert r.status_code == 200, r.text
            assert len(other.calls) == 1  # the full node's prefix was not followed
            for t in streams:
                assert (await t).status_code == 200
            text = (await client.get("/metrics")).text
            assert metric_value(text, "npugw_route_policy_decisions_total", model="remote", policy="prefix",
                                reason="load_fallback") == 1
    finally:
        await a.stop()
        await b.stop()


# ---- through a gateway tier -----------------------------------------------
@pytest.mark.asyncio
async def test_a_tier_keeps_a_shared_system_prompt_on_one_node() -> None:
    a, b = await FakeNode().start(), await FakeNode().start()
    try:
        settings = tier(f"remote={a.url},{b.url}", routing_policy=["prefix"])
        async with serve(None, settings) as (client, _):
            system = {"role": "system", "content": "You answer in French. " * 120}
            for i in range(6):
                body = {"model": "remote", "max_tokens": 5,
                        "messages": [system, {"role": "user", "content": f"question {i}"}]}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            assert sorted([len(a.calls), len(b.calls)]) == [0, 6]
            for i in range(4):  # sessions spread by their hash, not by the prompt
                body = {"model": "remote", "max_tokens": 5, "user": f"user-{i}",
                        "messages": [{"role": "user", "content": "hi"}]}
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
            hits = metric_value(text, "npugw_route_policy_decisions_total", model="remote", policy="prefix",
                                reason="prefix_hit")
            assert hits == 5
            assert metric_value(text, "npugw_route_policy_decisions_total", model="remote", policy="prefix",
                                reason="session") == 4
            assert metric_value(text, "npugw_route_prefix_match_length_count", model="remote", unit="bytes") == 6
    finally:
        await a.stop()
        await b.stop()
