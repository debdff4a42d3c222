"""WorkerPool on the simulated engine: admission, priorities, dispatch,
deadlines, aborts, supervision, readiness and drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineDead, QueueFull, QueueTimeout, RequestTimeout, ShuttingDown
from engine_adapter.lease import Prepared
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, GenerationRequest, ModelCard, SamplingOptions


def req(rid: str, max_tokens: int = 3, priority: int = 0, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="m", prompt_token_ids=(5, 6, 7),
        sampling=SamplingOptions(max_tokens=max_tokens), priority=priority, deadline=deadline,
    )


def make_pool(cfg: SimulatedConfig | None = None, **kw: object) -> tuple[WorkerPool, list[SimulatedEngine]]:
    engines: list[SimulatedEngine] = []

    def factory(i: int) -> SimulatedEngine:
        e = SimulatedEngine(cfg or SimulatedConfig(itl=0.01))
        engines.append(e)
        return e

    return WorkerPool("m", factory, **kw), engines  # type: ignore[arg-type]


async def batches(pool: WorkerPool, r: GenerationRequest) -> AsyncIterator[list[EngineOutput] | None]:
    """Admit `r`, then its outputs in batches."""
    lease = await pool.acquire(Prepared([r]))
    try:
        async for _, batch in lease.stream():
            yield batch
    finally:
        lease.release()


async def drain(pool: WorkerPool, r: GenerationRequest) -> list[EngineOutput]:
    return [o async for o in pool.generate(r) if o is not None]


@pytest.mark.asyncio
async def test_generate_streams_all_tokens_and_finishes() -> None:
    pool, _ = make_pool()
    await pool.start()
    outs = await drain(pool, req("a", max_tokens=4))
    assert len(outs) == 4 and outs[-1].finish_reason == "length"
    assert pool.running == 0 and pool.ready()
    await pool.stop()


@pytest.mark.asyncio
async def test_full_queue_rejects_at_once() -> None:
    pool, _ = make_pool(SimulatedConfig(itl=0.05), slots_per_worker=1, max_queue_size=1)
    await pool.start()
    first = asyncio.ensure_future(drain(pool, req("a", 10)))
    await wait_until(lambda: pool.running == 1)
    second = asyncio.ensure_future(drain(pool, req("b", 2)))
    await wait_until(lambda: pool.queue_depth == 1)
    with pytest.raises(QueueFull) as e:  # at once: the queue is full
        await pool.acquire(Prepared([req("c")]))
    assert pool.queue_depth == 1 and pool.running == 1
    assert e.value.retry_after
    assert pool.counters.rejected["queue_full"] == 1
    await asyncio.gather(first, second)
    await pool.stop()


@pytest.mark.asyncio
async def test_queue_wait_times_out_without_reaching_engine() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.1), slots_per_worker=1, max_queue_wait=0.2)
    await pool.start()
    before = engines[0].prompt_tokens_total  # the start-up readiness probe
    first = asyncio.ensure_future(drain(pool, req("a", 10)))
    await wait_until(lambda: pool.running == 1)
    with pytest.raises(QueueTimeout) as e:
        await drain(pool, req("late"))
    assert e.value.retry_after
    assert pool.queue_depth == 0
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    # the timed-out request never reached the engine
    assert engines[0].prompt_tokens_total == before + 3
    await pool.stop()


@pytest.mark.asyncio
async def test_priority_order_then_arrival_order() -> None:
    pool, _ = make_pool(SimulatedConfig(itl=0.01), slots_per_worker=1)
    await pool.start()
    order: list[str] = []

    async def run(r: GenerationRequest) -> None:
        async for _ in pool.generate(r):
            pass
        order.append(r.request_id)

    blocker = asyncio.ensure_future(run(req("blocker", 5)))
    await wait_until(lambda: pool.running == 1)
    tasks = []
    for k, (rid, prio) in enumerate([("low1", 5), ("high1", -1), ("low2", 5), ("mid", 0), ("high2", -1)]):
        tasks.append(asyncio.ensure_future(run(req(rid, 1, prio))))
        await wait_until(lambda k=k: pool.queue_depth == k + 1)  # type: ignore[misc]
    assert pool.queue_depth == 5
    assert pool.queue_depth_by_priority() == {5: 2, -1: 2, 0: 1}
    await asyncio.gather(blocker, *tasks)
    assert order == ["blocker", "high1", "high2", "mid", "low1", "low2"]
    await pool.stop()


@pytest.mark.asyncio
async def test_least_loaded_dispatch_over_workers() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.02), num_workers=2, slots_per_worker=4)
    await pool.start()
    tasks = [asyncio.ensure_future(drain(pool, req(f"r{i}", 5))) for i in range(6)]
    await wait_until(lambda: pool.running == 6)
    assert sorted(w.in_flight for w in pool.workers) == [3, 3]
    await asyncio.gather(*tasks)
    assert [w.in_flight for w in pool.workers] == [0, 0]
    assert all(e.generation_tokens_total > 0 for e in engines)
    await pool.stop()


@pytest.mark.asyncio
async def test_consumer_cancel_aborts_engine_request() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.05))
    await pool.start()
    task = asyncio.ensure_future(drain(pool, req("gone", 100)))
    await wait_until(lambda: engines[0].generation_tokens_total > 3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "gone" in engines[0].aborted
    assert engines[0].stats().unfinished == 0 and pool.running == 0
    assert pool.workers[0].in_flight == 0
    await pool.stop()


@pytest.mark.asyncio
async def test_deadline_aborts_and_says_why() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.05))
    await pool.start()
    with pytest.raises(RequestTimeout):
        await drain(pool, req("slow", 100, deadline=time.monotonic() + 0.15))
    assert "slow" in engines[0].aborted
    await pool.stop()


@pytest.mark.asyncio
async def test_idle_ticks_while_engine_is_quiet() -> None:
    pool, _ = make_pool(SimulatedConfig(ttft=0.25))
    await pool.start()
    items = [o async for o in pool.generate(req("k", 1), idle_tick=0.1)]
    assert items.count(None) >= 2 and isinstance(items[-1], EngineOutput)
    await pool.stop()


@pytest.mark.asyncio
async def test_dead_engine_fails_in_flight_and_restarts() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.02), restart_backoff=(0.01, 0.05))
    await pool.start()
    task = asyncio.ensure_future(drain(pool, req("victim", 100)))
    await wait_until(lambda: engines[0].generation_tokens_total > 2)
    engines[0].kill()
    with pytest.raises(EngineDead):
        await task
    await wait_until(lambda: pool.workers[0].restarts > 0, what="the restart")
    assert pool.workers[0].restarts == 1 and len(engines) == 2
    outs = await drain(pool, req("after", 2))
    assert len(outs) == 2
    await pool.stop()


class Unstarted(SimulatedEngine):
    """Like VllmEngine: no card before its first start ends (it keeps it
    once stopped); after the pool's first two, each start waits for `go`
    (the event loop runs meanwhile)."""

    go = asyncio.Event()
    starts = 0

    def __init__(self) -> None:
        super().__init__(SimulatedConfig(itl=0.01))
        self.has_card = False
        self.stops = 0

    @property
    def card(self) -> ModelCard:
        if not self.has_card:
            raise EngineDead("engine not started")
        return super().card

    async def start(self) -> None:
        Unstarted.starts += 1
        if Unstarted.starts > 2:
            await Unstarted.go.wait()
        self.has_card = True

    async def stop(self) -> None:
        self.stops += 1


@pytest.mark.asyncio
async def test_a_restarting_worker_leaves_the_pool_serving_and_a_stop_stops_its_new_engine() -> None:
    Unstarted.go, Unstarted.starts = asyncio.Event(), 0
    engines: list[Unstarted] = []

    def factory(i: int) -> Unstarted:
        engines.append(Unstarted())
        return engines[-1]

    pool = WorkerPool("m", factory, num_workers=2, restart_backoff=(0.01, 0.05))  # type: ignore[arg-type]
    await pool.start()
    engines[0].kill()
    with pytest.raises(EngineDead):
        await one_on_each(pool)
    await wait_until(lambda: len(engines) == 3, what="the restart's new engine")
    # worker 0's new engine is starting: the pool's card, and worker 1, serve
    assert pool.card.max_model_len > 0
    assert len(await drain(pool, req("meanwhile", 2))) == 2
    assert pool.workers[0].restarts == 0 and not pool.workers[0].alive
    await pool.stop()  # during the restart
    assert engines[2].stops == 1 and pool.workers[0].restarts == 0


async def one_on_each(pool: WorkerPool) -> None:
    """Two requests at once (least-loaded dispatch gives one to each worker);
    raises the first one's error."""
    results = await asyncio.gather(*(drain(pool, req(f"r{i}", 3)) for i in range(2)), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


@pytest.mark.asyncio
async def test_hung_engine_is_not_ready() -> None:
    pool, _ = make_pool(SimulatedConfig(hang=True), readiness_interval=0.2)
    await pool.start()  # the start probe times out: never ready
    assert not pool.ready()
    await pool.stop()


@pytest.mark.asyncio
async def test_ready_turns_false_when_engine_hangs_later() -> None:
    pool, engines = make_pool(SimulatedConfig(), readiness_interval=0.3)
    await pool.start()
    assert pool.ready()
    engines[0].config = SimulatedConfig(hang=True)
    await wait_until(lambda: not pool.ready(), timeout=10, what="the readiness probe to see the hung engine")
    await pool.stop()


@pytest.mark.asyncio
async def test_stop_drains_then_aborts_with_clean_errors() -> None:
    pool, _engines = make_pool(SimulatedConfig(itl=0.02), slots_per_worker=1)
    await pool.start()
    short = asyncio.ensure_future(drain(pool, req("short", 3)))
    await wait_until(lambda: pool.running == 1)
    queued = asyncio.ensure_future(drain(pool, req("queued", 3)))
    await wait_until(lambda: pool.queue_depth == 1)
    await pool.stop(timeout=1.0)
    assert len(await short) == 3  # in-flight work finished
    with pytest.raises(ShuttingDown):
        await queued
    with pytest.raises(ShuttingDown):
        await drain(pool, req("new"))

    pool2, engines2 = make_pool(SimulatedConfig(itl=0.05))
    await pool2.start()
    probed = engines2[0].generation_tokens_total  # the start-up probe's token
    long = asyncio.ensure_future(drain(pool2, req("long", 1000)))
    await wait_until(lambda: engines2[0].generation_tokens_total > probed)
    await pool2.stop(timeout=0.1)
    with pytest.raises(ShuttingDown):
        await long
    assert "long" in engines2[0].aborted


@pytest.mark.asyncio
async def test_batches_hold_what_was_ready_together() -> None:
    """A consumer that keeps up gets one engine step per batch; a slow one
    gets everything that piled up in one batch, in order, nothing twice."""
    pool, _ = make_pool(SimulatedConfig(itl=0.01))
    await pool.start()
    fast = [b async for b in batches(pool, req("fast", max_tokens=6)) if b is not None]
    assert [len(b) for b in fast] == [1] * 6
    slow: list[list[EngineOutput]] = []
    async for batch in batches(pool, req("slow", max_tokens=12)):
        assert batch is not None
        slow.append(batch)
        await asyncio.sleep(0.06)  # the client is behind by several steps
    flat = [o for b in slow for o in b]
    assert [o.text for o in flat] == [o.text for o in await drain(pool, req("ref", max_tokens=12))]
    assert len(flat) == 12 and flat[-1].finish_reason == "length"
    assert max(len(b) for b in slow) >= 3 and len(slow) < 12
    assert pool.running == 0
    await pool.stop()


@pytest.mark.asyncio
async def test_engine_death_while_batching_ends_the_stream_with_the_error() -> None:
    pool, engines = make_pool(SimulatedConfig(itl=0.01))
    await pool.start()
    got: list[EngineOutput] = []
    with pytest.raises(EngineDead):
        async for batch in batches(pool, req("a", max_tokens=50)):
            assert batch is not None
            got.extend(batch)
            if len(got) >= 2:
                engines[0].kill()
                await asyncio.sleep(0.05)  # more outputs and the error pile up meanwhile
    assert 2 <= len(got) < 50
    assert pool.running == 0
    await pool.stop()
