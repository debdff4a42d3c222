"""Passive readiness: an engine that produced output within the interval is
not probed and counts as ready; an idle one is probed once per interval; a
hung one turns not-ready at most 1.5 intervals after its last output."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, GenerationRequest
from server.settings import Settings


class CountingEngine(SimulatedEngine):
    """Counts the readiness probes it gets."""

    def __init__(self, config: SimulatedConfig) -> None:
        super().__init__(config)
        self.probes = 0

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if req.request_id.startswith("probe-"):
            self.probes += 1
        async for out in super().generate(req):
            yield out


def make_pool(interval: float, passive: bool = True) -> tuple[WorkerPool, list[CountingEngine]]:
    engines: list[CountingEngine] = []

    def factory(i: int) -> CountingEngine:
        e = CountingEngine(SimulatedConfig(itl=0.001))
        engines.append(e)
        return e

    pool = WorkerPool("m", factory, readiness_interval=interval)
    pool.passive_readiness = passive
    return pool, engines


async def feed_output(pool: WorkerPool, seconds: float) -> None:
    """The engine 'produces output' for `seconds` (what the producer records)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pool.workers[0].saw_output()
        assert pool.ready()
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_busy_engine_gets_no_probe_requests() -> None:
    pool, engines = make_pool(0.2)
    await pool.start()
    start_probes = engines[0].probes  # the start-up probe
    await feed_output(pool, 1.0)  # five intervals of output
    assert engines[0].probes == start_probes
    # idle again: probed, and stays ready
    await wait_until(lambda: engines[0].probes > start_probes, timeout=2.0, interval=0.01)
    assert pool.ready()
    await pool.stop()


@pytest.mark.asyncio
async def test_idle_engine_is_probed_once_per_interval_not_twice() -> None:
    interval = 0.2
    passive, p_engines = make_pool(interval)
    active, a_engines = make_pool(interval, passive=False)
    await passive.start()
    await active.start()
    await wait_until(lambda: a_engines[0].probes >= 9, timeout=5.0, interval=0.01)  # ~8 intervals idle
    p, a = p_engines[0].probes, a_engines[0].probes
    assert passive.ready() and active.ready()
    await passive.stop()
    await active.stop()
    assert p <= 0.7 * a, (p, a)


@pytest.mark.asyncio
async def test_active_mode_probes_a_busy_engine() -> None:
    pool, engines = make_pool(0.2, passive=False)
    await pool.start()
    start_probes = engines[0].probes
    feeding = asyncio.ensure_future(feed_output(pool, 2.0))
    await wait_until(lambda: engines[0].probes > start_probes, timeout=2.0, interval=0.01)
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)
    await pool.stop()


@pytest.mark.asyncio
async def test_hung_engine_turns_not_ready_within_one_and_a_half_intervals_of_its_last_output() -> None:
    interval = 0.4
    pool, engines = make_pool(interval)
    await pool.start()
    await feed_output(pool, 0.3)
    engines[0].config = SimulatedConfig(hang=True)  # no more output, probes hang
    last = pool.workers[0].last_output
    assert last is not None
    await wait_until(lambda: not pool.ready(), timeout=3 * interval, interval=0.01)
    assert time.monotonic() - last <= 1.5 * interval + 0.2
    # and it stays not ready while hung (its probes time out)
    end = time.monotonic() + 2 * interval
    while time.monotonic() < end:
        assert not pool.ready()
        await asyncio.sleep(0.02)
    await pool.stop()


def test_default_interval_turns_a_hung_engine_not_ready_in_under_10s() -> None:
    interval = float(Settings.model_fields["readiness_interval"].default)
    pool = WorkerPool("m", lambda i: SimulatedEngine(), readiness_interval=interval)
    pool._accepting = True
    w = pool.workers[0]
    w.alive = True
    w.last_ready = 100.0
    w.saw_output(now=200.0)  # the last output; the engine hangs after it
    assert pool.ready(now=200.0 + interval)
    assert not pool.ready(now=200.0 + 10.0 - 0.01)
    assert 1.5 * interval < 10.0
    pool.passive_readiness = False  # only the probe counts
    assert not pool.ready(now=200.0)
