"""cancel_and_wait ends a stop even when a loop swallowed the cancellation
(Python 3.11's wait_for can, CPython gh-86296), and a device monitor whose
probe answers just as it is cancelled still stops."""

from __future__ import annotations

import asyncio

import pytest
from support import wait_until

from engine_adapter.devices.monitor import DeviceMonitor
from engine_adapter.devices.probes import DeviceReading
from engine_adapter.tasks import cancel_and_wait


async def _swallows_once() -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # what a swallowed cancellation looks like to the loop: it goes on
    await asyncio.sleep(30)


@pytest.mark.asyncio
async def test_a_plain_cancel_does_not_stop_a_loop_that_swallowed_it() -> None:
    task = asyncio.ensure_future(_swallows_once())
    await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # the old stop (`task.cancel(); await task`) would wait 30 s here
    await cancel_and_wait([task])
    assert task.cancelled()


@pytest.mark.asyncio
async def test_cancel_and_wait_stops_it_and_drops_results_and_errors() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    swallowing = asyncio.ensure_future(_swallows_once())
    failed = asyncio.ensure_future(fails())
    finished = asyncio.ensure_future(asyncio.sleep(0, "x"))
    await wait_until(lambda: failed.done() and finished.done(), what="the quick tasks to end")
    await asyncio.wait_for(cancel_and_wait([swallowing, failed, finished], retry=0.05), 5)
    assert swallowing.cancelled() and failed.done() and finished.result() == "x"


class _RacingProbe:
    """Answers in the same loop turn as the monitor's stop cancels it."""

    name = "racing"

    def __init__(self) -> None:
        self.reads = 0

    async def read(self) -> list[DeviceReading]:
        self.reads += 1
        return []


@pytest.mark.asyncio
async def test_device_monitor_stops_with_a_probe_that_answers_at_once() -> None:
    probe = _RacingProbe()
    monitor = DeviceMonitor(probe)  # type: ignore[arg-type]
    for i in range(20):  # stop in every phase of the loop: reading, sleeping
        await monitor.start(0.001)
        await wait_until(lambda i=i: probe.reads > i, what="a probe read")  # type: ignore[misc]
        await asyncio.wait_for(monitor.stop(), 5)
        assert not monitor.running
    assert probe.reads > 0
