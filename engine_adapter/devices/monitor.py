"""Background refresh of device readings and their Prometheus export.

`DeviceMonitor` polls a probe on an interval and caches the result;
`DeviceCollector` exports the cache, so a scrape never waits on npu-smi.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from ..tasks import cancel_and_wait
from .probes import DeviceProbe, DeviceReading

logger = logging.getLogger(__name__)


class DeviceMonitor:
    """Caches `probe.read()` results, refreshed every `interval` s by `start()`.

    Each read is bounded by `timeout`. Failures are logged and counted in
    `errors`, never raised into the loop; the previous `readings` are kept (see
    `last_ok` / `last_refresh_ok` to judge staleness).
    """

    def __init__(
        self,
        probe: DeviceProbe,
        *,
        timeout: float = 15.0,
        clock: Callable[[], float] = time.time,
        busy_factor: float = 4.0,
        busy_utilization: float = 50.0,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        if busy_factor < 1:
            raise ValueError("busy_factor must be >= 1")
        self.probe = probe
        self.timeout = timeout
        # Under load the probe (npu-smi: a process and ~0.1-0.5 s of CPU per
        # call) runs on the cores that feed the device: read busy_factor
        # times less often while a device reads >= busy_utilization %.
        self.busy_factor = busy_factor
        self.busy_utilization = busy_utilization
        self._clock = clock
        self.readings: list[DeviceReading] = []
        self.errors = 0
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.last_refresh_ok = False
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def refresh(self) -> bool:
        """Read once; True on success. Never raises (except cancellation)."""
        try:
            readings = await asyncio.wait_for(self.probe.read(), self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a probe failure must never escape the loop
            msg = f"timed out after {self.timeout:g}s" if isinstance(e, asyncio.TimeoutError) else str(e)
            msg = f"{type(e).__name__}: {msg}"
            self.errors += 1
            # Warn on the first failure or a new kind of failure, not on every poll.
            level = logging.WARNING if self.last_refresh_ok or msg != self.last_error else logging.DEBUG
            logger.log(level, "device probe %s failed (%d errors so far): %s",
                       type(self.probe).__name__, self.errors, msg)
            self.last_error = msg
            self.last_refresh_ok = False
            return False
        self.readings = list(readings)
        self.last_ok = self._clock()
        if not self.last_refresh_ok and self.last_error is not None:
            logger.info("device probe %s recovered", type(self.probe).__name__)
        self.last_refresh_ok = True
        return True

    def busy(self) -> bool:
        """Whether the last readings show a device (or the host CPU) under load."""
        return any(
            r.utilization is not None and r.utilization >= self.busy_utilization
            for r in self.readings
            if r.kind != "process"
        )

    def next_interval(self, interval: float) -> float:
        return interval * self.busy_factor if self.last_refresh_ok and self.busy() else interval

    async def _loop(self, interval: float) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # refresh() does not raise; belt and braces for the loop
                self.errors += 1
                logger.exception("device monitor refresh crashed")
            await asyncio.sleep(self.next_interval(interval))

    async def start(self, interval: float) -> None:
        """Spawn the refresh task (first read right away)."""
        if interval <= 0:
            raise ValueError("interval must be > 0")
        if self.running:
            raise RuntimeError("DeviceMonitor already started")
        self._task = asyncio.create_task(self._loop(interval), name="npugw-device-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await cancel_and_wait([task])  # cancel again if a wait_for swallowed it (Python 3.11)


_MEM_NAME = "npu_memory_usage_bytes"
_AICORE_NAME = "npu_aicore_utilization_percent"
_HEALTH_NAME = "npu_health"
_GENERIC_MEM = "npugw_device_memory_bytes"
_GENERIC_UTIL = "npugw_device_utilization_percent"
_ERRORS = "npugw_device_probe_errors"
_UP = "npugw_device_probe_up"
_LAST_OK = "npugw_device_probe_last_success_timestamp_seconds"


class DeviceCollector:
    """prometheus_client collector over a DeviceMonitor's cached readings.

    NPU readings: `npu_memory_usage_bytes{type="used"|"total",device}`,
    `npu_aicore_utilization_percent{device}`, `npu_health{device}` (1 = OK).
    All readings: `npugw_device_memory_bytes{kind,device,type}`,
    `npugw_device_utilization_percent{kind,device}`. Probe state:
    `npugw_device_probe_errors_total`, `npugw_device_probe_up`,
    `npugw_device_probe_last_success_timestamp_seconds`.
    """

    def __init__(self, monitor: DeviceMonitor) -> None:
        self.monitor = monitor

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(_MEM_NAME, "NPU memory (HBM, or card memory without HBM) in bytes.",
                              labels=["type", "device"]),
            GaugeMetricFamily(_AICORE_NAME, "NPU AI Core utilization in percent.", labels=["device"]),
            GaugeMetricFamily(_HEALTH_NAME, "NPU health from npu-smi: 1 = OK, 0 = anything else.",
                              labels=["device"]),
            GaugeMetricFamily(_GENERIC_MEM, "Device memory in bytes, any device kind.",
                              labels=["kind", "device", "type"]),
            GaugeMetricFamily(_GENERIC_UTIL, "Device utilization in percent, where known.",
                              labels=["kind", "device"]),
            GaugeMetricFamily(_UP, "1 if the last device probe succeeded."),
            GaugeMetricFamily(_LAST_OK, "Unix time of the last successful device probe."),
        )

    def describe(self) -> Iterable[Metric]:
        yield from self._families()
        yield CounterMetricFamily(_ERRORS, "Failed device probe reads.")

    def collect(self) -> Iterator[Metric]:
        mem, aicore, health, gmem, gutil, up, last_ok = self._families()
        seen: set[tuple[str, str]] = set()
        for r in self.monitor.readings:
            if (r.kind, r.device) in seen:
                continue  # duplicate series would make the scrape invalid
            seen.add((r.kind, r.device))
            gmem.add_metric([r.kind, r.device, "used"], r.used_bytes)
            gmem.add_metric([r.kind, r.device, "total"], r.total_bytes)
            if r.utilization is not None:
                gutil.add_metric([r.kind, r.device], r.utilization)
            if r.kind != "npu":
                continue
            mem.add_metric(["used", r.device], r.used_bytes)
            mem.add_metric(["total", r.device], r.total_bytes)
            if r.utilization is not None:
                aicore.add_metric([r.device], r.utilization)
            if r.health is not None:
                health.add_metric([r.device], 1.0 if r.health == "OK" else 0.0)
        up.add_metric([], 1.0 if self.monitor.last_refresh_ok else 0.0)
        if self.monitor.last_ok is not None:
            last_ok.add_metric([], self.monitor.last_ok)
        errors = CounterMetricFamily(_ERRORS, "Failed device probe reads.")
        errors.add_metric([], float(self.monitor.errors))
        yield from (mem, aicore, health, gmem, gutil, up, last_ok, errors)
