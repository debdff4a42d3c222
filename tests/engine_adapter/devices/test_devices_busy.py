"""Device probes run less often while the device (or host CPU) is busy."""

from __future__ import annotations

import asyncio

import pytest

from engine_adapter.devices import DeviceMonitor, DeviceReading


class FixedProbe:
    def __init__(self, utilization: float | None) -> None:
        self.utilization = utilization
        self.calls = 0

    async def read(self) -> list[DeviceReading]:
        self.calls += 1
        return [
            DeviceReading("npu", "0", 1, 2, utilization=self.utilization),
            DeviceReading("process", "gateway", 1, 2, utilization=100.0),  # not a device: ignored
        ]


@pytest.mark.asyncio
async def test_busy_device_is_read_less_often() -> None:
    probe = FixedProbe(90.0)
    mon = DeviceMonitor(probe, busy_factor=4.0)
    assert await mon.refresh()
    assert mon.busy() and mon.next_interval(5.0) == 20.0
    probe.utilization = 10.0
    assert await mon.refresh()
    assert not mon.busy() and mon.next_interval(5.0) == 5.0
    probe.utilization = None  # unknown utilization: the normal interval
    assert await mon.refresh()
    assert mon.next_interval(5.0) == 5.0


@pytest.mark.asyncio
async def test_loop_backs_off_under_load() -> None:
    busy, idle = FixedProbe(100.0), FixedProbe(0.0)
    monitors = [DeviceMonitor(busy, busy_factor=10.0), DeviceMonitor(idle, busy_factor=10.0)]
    for m in monitors:
        await m.start(0.02)
    loop = asyncio.get_running_loop()
    end = loop.time() + 5.0
    while idle.calls < 12 and loop.time() < end:
        await asyncio.sleep(0.01)
    for m in monitors:
        await m.stop()
    assert idle.calls >= 12
    assert busy.calls * 3 < idle.calls


def test_busy_factor_must_not_speed_up() -> None:
    with pytest.raises(ValueError):
        DeviceMonitor(FixedProbe(0.0), busy_factor=0.5)
