"""The pool's queue: weighted deficit round robin between keys inside a
priority, priorities first, no starvation, leaving waiters, policy switches;
and deadline-aware admission on a pool of simulated engines."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import DeadlineUnmeetable, QueueTimeout, ShuttingDown
from engine_adapter.lease import Prepared
from engine_adapter.pool import WorkerPool
from engine_adapter.scheduler import FairQueue, Policy, Waiter
from engine_adapter.types import GenerationRequest, SamplingOptions


def waiter(tenant: str, seq: int, cost: int = 100, priority: int = 0) -> Waiter:
    return Waiter(priority, seq, None, tenant=tenant, cost=cost)  # type: ignore[arg-type]  # no loop: the queue never reads it


def fill(q: FairQueue, spec: list[tuple[str, int]], cost: int = 100, priority: int = 0) -> list[Waiter]:
    """(tenant, count) each, interleaved in arrival order as listed (all of
    the first tenant's, then the next's)."""
    out = []
    seq = len(list(q.waiters()))
    for tenant, n in spec:
        for _ in range(n):
            w = waiter(tenant, seq, cost, priority)
            seq += 1
            q.push(w)
            out.append(w)
    return out


def order(q: FairQueue) -> list[str]:
    out = []
    while (w := q.pop()) is not None:
        out.append(w.tenant)
    return out


def test_fair_alternates_between_keys_where_fifo_serves_the_flood_first() -> None:
    for policy, want in (("fair", ["a", "b", "a", "b", "a", "b", "a", "a"]), ("fifo", ["a"] * 5 + ["b"] * 3)):
        q = FairQueue(policy, quantum=100)  # type: ignore[arg-type]
        fill(q, [("a", 5), ("b", 3)])
        assert order(q) == want, policy


def test_weights_share_in_proportion_to_cost() -> None:
    q = FairQueue("fair", quantum=100)
    q.weights = {"heavy": 3.0}
    fill(q, [("heavy", 60), ("light", 60)])
    first = Counter(order(q)[:40])
    assert first["heavy"] == 30 and first["light"] == 10


def test_cost_counts_not_requests() -> None:
    """Same weight: a key of 400-token requests gets one for every four of a
    key of 100-token requests."""
    q = FairQueue("fair", quantum=100)
    fill(q, [("big", 10)], cost=400)
    fill(q, [("small", 40)], cost=100)
    first = Counter(order(q)[:25])
    assert first["small"] == 20 and first["big"] == 5


def test_lower_priority_value_leaves_first_whatever_the_key() -> None:
    q = FairQueue("fair")
    fill(q, [("a", 3)], priority=10)
    fill(q, [("b", 2)], priority=0)
    fill(q, [("c", 1)], priority=5)
    assert order(q) == ["b", "b", "c", "a", "a", "a"]


def test_a_key_with_weight_one_among_weight_100_still_progresses() -> None:
    q = FairQueue("fair", quantum=10)
    q.weights = {"x": 100.0, "y": 100.0}
    fill(q, [("x", 3000), ("y", 3000), ("slow", 5)], cost=500)
    served = order(q)[:1000]
    # it gets about 1/201 of the work: at least 4 of its 5 in the first 1000
    assert served.count("slow") >= 4


def test_a_huge_request_with_a_tiny_weight_is_served_without_spinning() -> None:
    q = FairQueue("fair", quantum=1)
    q.weights = {"tiny": 0.001}
    fill(q, [("tiny", 1)], cost=1_000_000)
    t0 = time.perf_counter()
    assert order(q) == ["tiny"]
    assert time.perf_counter() - t0 < 0.1  # rounds are skipped, not looped through


def test_a_waiter_that_leaves_is_removed_and_its_key_loses_its_turn() -> None:
    q = FairQueue("fair", quantum=100)
    a = fill(q, [("a", 1)])
    fill(q, [("b", 2)])
    assert q.remove(a[0]) and not q.remove(a[0])
    assert len(q) == 2 and q.depth_by_tenant() == {"b": 2}
    assert order(q) == ["b", "b"]


def test_switching_policy_keeps_every_waiter() -> None:
    q = FairQueue("fifo", quantum=100)
    ws = fill(q, [("a", 4), ("b", 2)]) + fill(q, [("c", 1)], priority=3)
    for policy in ("fair", "fifo", "fair"):
        q.set_policy(policy)  # type: ignore[arg-type]
        assert len(q) == 7 and set(q.waiters()) == set(ws)
    assert order(q) == ["a", "b", "a", "b", "a", "a", "c"]
    with pytest.raises(ValueError):
        q.set_policy("lifo")  # type: ignore[arg-type]


def test_a_key_new_to_the_queue_goes_ahead_of_keys_that_keep_one() -> None:
    q = FairQueue("fair", quantum=1)
    q.weights = {"flood": 50.0}  # even a heavier key waits for a new key's first request
    fill(q, [("flood", 4)])
    assert q.pop() is not None  # the flood's key had its turn: it keeps a queue
    fill(q, [("c", 1), ("d", 1)])  # new keys, in arrival order, before the flood's next
    q.push(waiter("busy", 99), running=True)  # a key with requests running is not new
    assert order(q) == ["c", "d", "flood", "flood", "flood", "busy"]  # then by weight


def test_upcoming_does_not_change_the_queue() -> None:
    q = FairQueue("fair", quantum=100)
    fill(q, [("a", 3), ("b", 3)])
    peek = [w.tenant for w in q.upcoming(4)]
    assert peek == ["a", "b", "a", "b"] and len(q) == 6
    assert order(q)[:4] == peek


def test_work_ahead_counts_the_fair_position() -> None:
    q = FairQueue("fair")
    fill(q, [("flood", 50)], cost=100)
    # a new key's request of 100 waits behind at most one flood request's worth
    assert q.work_ahead(0, "new", 100) == 100
    assert q.work_ahead(0, "flood", 100) == 5000
    fifo = FairQueue("fifo")
    fill(fifo, [("flood", 50)], cost=100)
    assert fifo.work_ahead(0, "new", 100) == 5000
    fill(q, [("urgent", 2)], cost=300, priority=-1)
    assert q.work_ahead(0, "new", 100) == 700
    assert q.work_ahead(-2, "new", 100) == 0


# ---- on a pool ----------------------------------------------------------


def req(rid: str, key: str | None, max_tokens: int = 4, ttft: float | None = None,
        priority: int = 0) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="m", prompt_token_ids=(5, 6, 7), sampling=SamplingOptions(max_tokens=max_tokens),
        api_key_name=key, ttft_deadline=ttft, priority=priority,
    )


def make_pool(policy: Policy = "fair", itl: float = 0.01, **kw: object) -> WorkerPool:
    return WorkerPool("m", lambda i: SimulatedEngine(SimulatedConfig(itl=itl)), slots_per_worker=1,
                      queue_policy=policy, **kw)  # type: ignore[arg-type]


async def run(pool: WorkerPool, r: GenerationRequest, served: list[str]) -> None:
    lease = await pool.acquire(Prepared([r]))
    served.append(r.api_key_name or "")
    try:
        async for _ in lease.stream():
            pass
    finally:
        lease.release()


@pytest.mark.parametrize("policy", ["fair", "fifo"])
@pytest.mark.asyncio
async def test_a_second_key_is_served_after_one_slot_turnover_only_when_fair(policy: Policy) -> None:
    pool = make_pool(policy)
    await pool.start()
    served: list[str] = []
    flood = [asyncio.ensure_future(run(pool, req(f"a{i}", "a"), served)) for i in range(8)]
    await wait_until(lambda: pool.queue_depth == 7, what="the flood to queue")
    b = asyncio.ensure_future(run(pool, req("b", "b"), served))
    await asyncio.gather(b, *flood)
    # fair: the flood's key has a request running, so b goes next
    assert served.index("b") == (1 if policy == "fair" else 8)
    await pool.stop()


@pytest.mark.asyncio
async def test_a_queued_client_that_leaves_is_removed() -> None:
    pool = make_pool(itl=0.05)
    await pool.start()
    served: list[str] = []
    first = asyncio.ensure_future(run(pool, req("a0", "a", max_tokens=20), served))
    await wait_until(lambda: pool.running == 1)
    gone = asyncio.ensure_future(pool.acquire(Prepared([req("b", "b")])))
    await wait_until(lambda: pool.queue_depth == 1)
    assert pool.queue.depth_by_tenant() == {"b": 1}
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert pool.queue_depth == 0 and pool.queue.depth_by_tenant() == {}
    await first
    assert pool.workers[0].in_flight == 0
    await pool.stop()


@pytest.mark.asyncio
async def test_drain_refuses_the_queue_cleanly() -> None:
    pool = make_pool(itl=0.05)
    await pool.start()
    served: list[str] = []
    first = asyncio.ensure_future(run(pool, req("a0", "a", max_tokens=5), served))
    await wait_until(lambda: pool.running == 1)
    waiting = [asyncio.ensure_future(pool.acquire(Prepared([req(f"q{i}", k)]))) for i, k in enumerate("abab")]
    await wait_until(lambda: pool.queue_depth == 4)
    await pool.stop(timeout=5)
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, ShuttingDown) for r in results)
    await first
    assert pool.queue_depth == 0 and served == ["a"]


async def measured_pool() -> WorkerPool:
    """A one-slot pool whose service rate is measured: a flood went through."""
    pool = make_pool(itl=0.01)
    await pool.start()
    served: list[str] = []
    await asyncio.gather(*(run(pool, req(f"w{i}", "warm"), served) for i in range(8)))
    assert pool.queue_stats.rate.per_second is not None
    return pool


@pytest.mark.asyncio
async def test_a_deadline_the_queue_cannot_meet_is_refused_at_arrival() -> None:
    pool = await measured_pool()
    served: list[str] = []
    busy = [asyncio.ensure_future(run(pool, req(f"a{i}", "a", max_tokens=30), served)) for i in range(4)]
    await wait_until(lambda: pool.queue_depth == 3)
    t0 = time.monotonic()
    with pytest.raises(DeadlineUnmeetable) as refused:
        await pool.acquire(Prepared([req("b", "a", ttft=t0 + 0.05)]))  # behind ~90 tokens of its own key at 10 ms each
    assert time.monotonic() - t0 < 0.05 and refused.value.code == "deadline_unmeetable"
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1
    assert pool.queue_depth == 3 and pool.queue_stats.refused[("a", "deadline_unmeetable")] == 1
    # a generous deadline is admitted, and its estimate's error is recorded
    await run(pool, req("c", "c", ttft=time.monotonic() + 30), served)
    await asyncio.gather(*busy)
    assert pool.queue_stats.estimate_error.n >= 1
    await pool.stop()


@pytest.mark.asyncio
async def test_a_queued_request_whose_deadline_passes_leaves_with_the_same_refusal() -> None:
    pool = make_pool(itl=0.05, max_queue_wait=30)  # no rate measured yet: admitted, then expires
    await pool.start()
    served: list[str] = []
    busy = asyncio.ensure_future(run(pool, req("a0", "a", max_tokens=20), served))
    await wait_until(lambda: pool.running == 1)
    with pytest.raises(DeadlineUnmeetable):
        await pool.acquire(Prepared([req("b", "b", ttft=time.monotonic() + 0.1)]))
    assert pool.queue_depth == 0 and pool.queue_stats.refused[("b", "deadline_expired")] == 1
    # without a TTFT deadline the queue wait limit still says queue timeout
    short = make_pool(itl=0.05, max_queue_wait=0.1)
    await short.start()
    hold = asyncio.ensure_future(run(short, req("x", "a", max_tokens=20), served))
    await wait_until(lambda: short.running == 1)
    with pytest.raises(QueueTimeout):
        await short.acquire(Prepared([req("y", "b")]))
    await asyncio.gather(busy, hold)
    await pool.stop()
    await short.stop()


@pytest.mark.asyncio
async def test_switching_policy_while_requests_queue_loses_none() -> None:
    pool = make_pool("fifo", itl=0.01)
    await pool.start()
    served: list[str] = []
    tasks = [asyncio.ensure_future(run(pool, req(f"r{i}", "ab"[i % 2]), served)) for i in range(10)]
    await wait_until(lambda: pool.queue_depth == 9)
    pool.set_queue_policy("fair")
    assert pool.queue_depth == 9 and pool.queue_policy == "fair"
    await asyncio.gather(*tasks)
    assert Counter(served) == {"a": 5, "b": 5} and pool.queue_depth == 0
    await pool.stop()
