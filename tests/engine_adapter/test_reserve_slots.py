"""Reserve slots (--fair-reserve-slots): the extra engine slots per worker
that admission gives only to a key's new flow (nothing running, nothing
queued) or to a request more urgent than every running one, with the `fair`
policy; ordinary requests never see them. Leases are held without streaming,
so who holds which slot is decided by admission alone."""

from __future__ import annotations

import asyncio

import pytest
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.lease import PoolLease, Prepared
from engine_adapter.pool import WorkerPool
from engine_adapter.scheduler import Policy
from engine_adapter.types import GenerationRequest, SamplingOptions


def req(rid: str, key: str, priority: int = 0) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt_token_ids=(5, 6, 7),
                             sampling=SamplingOptions(max_tokens=4), api_key_name=key, priority=priority)


async def started(policy: Policy = "fair", slots: int = 1, reserve: int = 1) -> WorkerPool:
    pool = WorkerPool("m", lambda i: SimulatedEngine(SimulatedConfig(itl=0.01)), slots_per_worker=slots,
                      reserve_slots=reserve, queue_policy=policy, readiness_interval=60)
    await pool.start()
    return pool


async def now(pool: WorkerPool, rid: str, key: str, priority: int = 0) -> PoolLease:
    """A lease that must be granted without waiting in the queue."""
    return await asyncio.wait_for(pool.acquire(Prepared([req(rid, key, priority)])), 5)


def queued(pool: WorkerPool, rid: str, key: str, priority: int = 0) -> asyncio.Future[PoolLease]:
    return asyncio.ensure_future(pool.acquire(Prepared([req(rid, key, priority)])))


def held(pool: WorkerPool) -> tuple[int, int]:
    """(slots taken, of which reserve slots) on the only worker."""
    (w,) = pool.workers
    return w.in_flight, w.reserved


@pytest.mark.asyncio
async def test_a_new_keys_request_takes_the_reserve_slot_while_the_flood_holds_every_ordinary_one() -> None:
    pool = await started(slots=2, reserve=1)
    flood = [await now(pool, f"a{i}", "a") for i in range(2)]
    waiting = [queued(pool, f"a{i}", "a") for i in range(2, 6)]
    await wait_until(lambda: pool.queue_depth == 4, what="the flood to queue")
    b = await now(pool, "b", "b")  # would wait for a turnover without the reserve
    assert held(pool) == (3, 1) and pool.queue_depth == 4 and pool.reserve_running == 1
    assert pool.queue_stats.reserve_admitted == {"new_flow": 1}
    assert pool.capacity == 2 and pool.reserve == 1 and pool.workers[0].free == 0
    for lease in (b, *flood):
        lease.release()
    for f in waiting:  # in arrival order, each once it has a slot
        (await f).release()
    assert held(pool) == (0, 0)
    await pool.stop()


@pytest.mark.asyncio
async def test_a_key_with_a_request_running_or_queued_does_not_get_one() -> None:
    pool = await started(slots=1, reserve=2)  # room in the reserve: only the rule keeps them out
    a = await now(pool, "a0", "a")
    a_more = queued(pool, "a1", "a")  # a has one running: it waits for the ordinary slot
    await wait_until(lambda: pool.queue_depth == 1)
    b = await now(pool, "b0", "b")
    b_more = queued(pool, "b1", "b")  # b's second request, its first running on the reserve
    await wait_until(lambda: pool.queue_depth == 2)
    assert held(pool) == (2, 1) and pool.queue.depth_by_tenant() == {"a": 1, "b": 1}
    a.release()  # the ordinary slot goes to the queue (a's, first to arrive); b still runs: no reserve
    first = await asyncio.wait_for(asyncio.shield(a_more), 5)
    assert held(pool) == (2, 1) and pool.queue.depth_by_tenant() == {"b": 1}
    b.release()  # now b has nothing running and only this one queued: a new flow, onto the reserve
    second = await asyncio.wait_for(asyncio.shield(b_more), 5)
    assert held(pool) == (2, 1) and pool.queue_stats.reserve_admitted == {"new_flow": 2}
    for lease in (first, second):
        lease.release()
    assert held(pool) == (0, 0) and pool.admission.running_by_tenant == {}
    await pool.stop()


@pytest.mark.asyncio
async def test_the_reserve_slot_goes_back_when_its_lease_ends_and_to_a_queued_new_flow() -> None:
    pool = await started(slots=1, reserve=1)
    a = await now(pool, "a0", "a")
    flood = [queued(pool, f"a{i}", "a") for i in range(1, 4)]
    await wait_until(lambda: pool.queue_depth == 3)
    b = await now(pool, "b", "b")
    c = queued(pool, "c", "c")  # new too, but the only reserve slot is b's: c waits, first in line
    await wait_until(lambda: pool.queue_depth == 4)
    assert [w.tenant for w in pool.queue.upcoming(2)] == ["c", "a"]
    b.release()  # b's reserve slot is back: it goes to c while a still holds the ordinary slot
    c_lease = await asyncio.wait_for(asyncio.shield(c), 5)
    assert held(pool) == (2, 1) and pool.queue_depth == 3
    assert pool.queue_stats.reserve_admitted["new_flow"] == 2
    c_lease.release()
    assert held(pool) == (1, 0) and pool.queue_depth == 3  # the flood's key never takes it
    a.release()
    for f in flood:
        (await f).release()
    assert held(pool) == (0, 0) and pool.reserve_running == 0
    await pool.stop()


@pytest.mark.asyncio
async def test_more_urgent_than_every_running_request_gets_one_and_new_flows_do_not_overtake_urgent_work(
) -> None:
    pool = await started(slots=1, reserve=2)
    batch = await now(pool, "a0", "a", priority=10)
    urgent = await now(pool, "a1", "a", priority=0)  # a runs already, but 0 < 10
    assert held(pool) == (2, 1) and pool.queue_stats.reserve_admitted == {"priority": 1}
    same = queued(pool, "a2", "a", priority=0)  # not more urgent than a1, and a runs: it waits
    await wait_until(lambda: pool.queue_depth == 1)
    late = queued(pool, "c0", "c", priority=10)  # new, but priority-0 work waits: no overtaking it
    await wait_until(lambda: pool.queue_depth == 2)
    assert held(pool) == (2, 1)
    d = await now(pool, "d0", "d", priority=0)  # new, and nothing more urgent waits
    assert held(pool) == (3, 2) and pool.queue_stats.reserve_admitted == {"priority": 1, "new_flow": 1}
    for lease in (batch, urgent, d):
        lease.release()
    for f in (same, late):
        (await f).release()
    assert held(pool) == (0, 0) and pool.admission.running_by_priority == {}
    await pool.stop()


@pytest.mark.parametrize("policy, reserve", [("fifo", 1), ("fair", 0)])
@pytest.mark.asyncio
async def test_fifo_never_uses_the_reserve_and_without_one_a_new_key_waits_as_before(
    policy: Policy, reserve: int
) -> None:
    pool = await started(policy, slots=1, reserve=reserve)
    a = await now(pool, "a0", "a")
    b = queued(pool, "b", "b")
    await wait_until(lambda: pool.queue_depth == 1)
    assert held(pool) == (1, 0) and not b.done() and not pool.queue_stats.reserve_admitted
    a.release()
    (await asyncio.wait_for(b, 5)).release()  # the ordinary slot's turnover
    assert held(pool) == (0, 0)
    await pool.stop()


@pytest.mark.asyncio
async def test_a_new_key_streams_while_the_flood_still_holds_every_ordinary_slot() -> None:
    """The whole path (admission, runner, lease): b's answer is complete
    before any of the flood's long answers ends."""
    pool = WorkerPool("m", lambda i: SimulatedEngine(SimulatedConfig(itl=0.02)), slots_per_worker=2,
                      reserve_slots=1, readiness_interval=60)
    await pool.start()
    done: list[str] = []

    async def run(rid: str, key: str, tokens: int) -> None:
        r = GenerationRequest(request_id=rid, model="m", prompt_token_ids=(5, 6, 7),
                              sampling=SamplingOptions(max_tokens=tokens), api_key_name=key)
        async for _ in pool.generate(r):
            pass
        done.append(rid)

    flood = [asyncio.ensure_future(run(f"a{i}", "a", 200)) for i in range(6)]
    await wait_until(lambda: pool.queue_depth == 4 and pool.running == 2, what="the flood to fill the slots")
    await asyncio.wait_for(run("b", "b", 4), 10)
    assert done == ["b"] and pool.queue_depth == 4
    for t in flood:
        t.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    await pool.stop()


def test_peek_is_the_next_pop_and_queued_counts_a_keys_waiters_in_every_priority() -> None:
    from engine_adapter.scheduler import FairQueue, Waiter

    q = FairQueue("fair", quantum=1)
    for seq, (tenant, prio, cost) in enumerate([("a", 5, 7), ("a", 5, 7), ("b", 5, 30), ("a", 0, 7), ("c", 5, 1)]):
        q.push(Waiter(prio, seq, None, tenant=tenant, cost=cost), running=tenant == "a")  # type: ignore[arg-type]
    assert (q.queued("a"), q.queued("b"), q.queued("z"), q.best_priority()) == (3, 1, 0, 0)
    while q:
        nxt = q.peek()
        assert nxt is not None and q.pop() is nxt
    assert q.peek() is None and q.best_priority() is None
