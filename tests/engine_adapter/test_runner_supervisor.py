"""The pool's owned parts on their own: the Runner (runs an admitted request,
never touches slots) and the Supervisor (restarts a dead worker, answers
readiness), each built with plain callables for what it needs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.errors import EngineDead, RequestTimeout, ShuttingDown
from engine_adapter.lease import Slot, Worker
from engine_adapter.running import Runner
from engine_adapter.supervision import Supervisor
from engine_adapter.types import EngineOutput, GenerationRequest, SamplingOptions


def req(rid: str, max_tokens: int = 3, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="m", prompt_token_ids=(5, 6, 7),
        sampling=SamplingOptions(max_tokens=max_tokens), deadline=deadline,
    )


async def live_worker(cfg: SimulatedConfig) -> Worker:
    engine = SimulatedEngine(cfg)
    await engine.start()
    return Worker(index=0, engine=engine, slots=4, in_flight=1, alive=True)


@pytest.mark.asyncio
async def test_runner_streams_a_request_and_leaves_the_slot_to_the_lease() -> None:
    dead: list[Worker] = []
    runner = Runner("m", on_dead=lambda w, e: dead.append(w), accepting=lambda: True)
    w = await live_worker(SimulatedConfig(itl=0.001))
    slot = Slot(w, cost=6)
    outs: list[EngineOutput] = []
    async for batch in runner.run(slot, req("a", max_tokens=4)):
        assert batch is not None
        outs.extend(batch)
        assert runner.running == 1
    assert len(outs) == 4 and outs[-1].finish_reason == "length"
    assert runner.running == 0 and not dead
    # the runner never gives the slot back: that is the lease's job
    assert not slot.released and w.in_flight == 1


@pytest.mark.asyncio
async def test_runner_reports_a_dead_engine_to_its_supervisor_callback() -> None:
    dead: list[tuple[Worker, BaseException]] = []
    runner = Runner("m", on_dead=lambda w, e: dead.append((w, e)), accepting=lambda: True)
    w = await live_worker(SimulatedConfig(itl=0.01))
    w.engine.kill()  # type: ignore[attr-defined]
    with pytest.raises(EngineDead):
        async for _ in runner.run(Slot(w), req("a")):
            pass
    assert [x for x, _ in dead] == [w] and isinstance(dead[0][1], EngineDead)


@pytest.mark.asyncio
async def test_runner_deadline_aborts_the_engine_request() -> None:
    runner = Runner("m", on_dead=lambda w, e: None, accepting=lambda: True)
    w = await live_worker(SimulatedConfig(itl=0.05))
    with pytest.raises(RequestTimeout):
        async for _ in runner.run(Slot(w), req("a", max_tokens=100, deadline=time.monotonic() + 0.15)):
            pass
    await wait_until(lambda: w.engine.aborted == ["a"], what="the abort")  # type: ignore[attr-defined]
    assert runner.running == 0


@pytest.mark.asyncio
async def test_runner_says_shutting_down_when_cancelled_while_not_accepting() -> None:
    accepting = [True]
    runner = Runner("m", on_dead=lambda w, e: None, accepting=lambda: accepting[0])
    w = await live_worker(SimulatedConfig(itl=0.05))
    run = runner.run(Slot(w), req("a", max_tokens=100))
    first = await run.__anext__()
    assert first
    accepting[0] = False
    for t in list(w.tasks):
        t.cancel()  # what a pool's stop does
    with pytest.raises(ShuttingDown):
        async for _ in run:
            pass
    assert runner.running == 0


class Spawner:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, coro: Awaitable[None]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))


@pytest.mark.asyncio
async def test_supervisor_restarts_a_dead_worker_then_wakes_its_waiters() -> None:
    built: list[SimulatedEngine] = []

    def factory(i: int) -> SimulatedEngine:
        e = SimulatedEngine(SimulatedConfig())
        built.append(e)
        return e

    w = await live_worker(SimulatedConfig())
    first = w.engine
    forgotten: list[int] = []
    woken: list[Worker] = []
    spawn = Spawner()
    sup = Supervisor(
        "m", [w], factory, spawn=spawn, accepting=lambda: True, forget=forgotten.append,
        wake=woken.append, readiness_interval=1.0, restart_backoff=(0.01, 0.05),
    )
    sup.on_dead(w, EngineDead("test"))
    assert not w.alive and forgotten == [0] and sup.alive_workers() == 0
    sup.on_dead(w, EngineDead("again"))  # a second report of the same death does nothing
    assert len(spawn.tasks) == 1
    await asyncio.gather(*spawn.tasks)
    assert w.alive and w.restarts == 1 and w.engine is built[0] and w.engine is not first
    assert woken == [w] and sup.ready_workers() == 1  # probed after the restart


@pytest.mark.asyncio
async def test_supervisor_does_not_restart_while_draining() -> None:
    w = await live_worker(SimulatedConfig())
    spawn = Spawner()
    sup = Supervisor("m", [w], lambda i: SimulatedEngine(), spawn=spawn, accepting=lambda: False,
                     forget=lambda i: None, wake=lambda w: None)
    sup.on_dead(w, EngineDead("test"))
    assert not w.alive and spawn.tasks == []


def test_supervisor_readiness_window_follows_the_probe_mode() -> None:
    w = Worker(index=0, engine=SimulatedEngine(), slots=1, alive=True)
    sup = Supervisor("m", [w], lambda i: SimulatedEngine(), spawn=lambda c: None, accepting=lambda: True,
                     forget=lambda i: None, wake=lambda w: None, readiness_interval=2.0)
    w.saw_output(now=100.0)
    assert sup.ready_window() == 3.0 and sup.ready_workers(now=102.9) == 1 and sup.ready_workers(now=103.1) == 0
    sup.passive_readiness = False  # only probes and finished requests count
    assert sup.ready_window() == 2.0 and sup.ready_workers(now=100.0) == 0
