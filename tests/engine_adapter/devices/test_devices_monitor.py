"""DeviceMonitor background refresh and the DeviceCollector Prometheus export."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import wait_until

from engine_adapter.devices import (
    CpuProbe,
    DeviceCollector,
    DeviceMonitor,
    DeviceReading,
    NpuSmiProbe,
)

MIB = 1024 * 1024
Script = Callable[[str], Path]
F_910B1 = "910b1_8npu_24.1.0_procs_vllm-ascend-312.txt"
F_910B2C_16 = "910b2c_16npu_24.1.rc1_procs_vllm-ascend-264.txt"
F_A3 = "a3_910_93_16chip_25.2.0_procs_vllm-ascend-3002.txt"
F_310B4 = "310b4_alarm_23.0.0_nputop-test.txt"
F_ERR_8005 = "error_dcmi_init_-8005_vllm-ascend-2698.txt"

Samples = dict[str, list[tuple[dict[str, str], float]]]


class ScriptedProbe:
    """Returns / raises the queued outcomes in order, repeating the last one."""

    def __init__(self, *outcomes: list[DeviceReading] | Exception, delay: float = 0.0) -> None:
        self.outcomes = list(outcomes)
        self.delay = delay
        self.calls = 0

    async def read(self) -> list[DeviceReading]:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        outcome = self.outcomes[min(self.calls, len(self.outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def scrape(monitor: DeviceMonitor) -> Samples:
    registry = CollectorRegistry()
    registry.register(DeviceCollector(monitor))
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def by_device(samples: Samples, name: str, **match: str) -> dict[str, float]:
    return {
        labels["device"]: value
        for labels, value in samples.get(name, [])
        if all(labels.get(k) == v for k, v in match.items())
    }


READING = DeviceReading("npu", "0", 10, 100, utilization=5.0, health="OK")


@pytest.mark.asyncio
async def test_refresh_with_npu_smi_script(cat_fixture_script: Script) -> None:
    monitor = DeviceMonitor(NpuSmiProbe(str(cat_fixture_script(F_910B1))), clock=lambda: 1234.5)
    assert await monitor.refresh() is True
    assert len(monitor.readings) == 8
    assert (monitor.errors, monitor.last_ok, monitor.last_refresh_ok) == (0, 1234.5, True)


@pytest.mark.asyncio
async def test_start_refreshes_in_background_and_stop() -> None:
    probe = ScriptedProbe([READING])
    monitor = DeviceMonitor(probe)
    await monitor.start(0.02)
    assert monitor.running
    with pytest.raises(RuntimeError, match="already started"):
        await monitor.start(0.02)
    await wait_until(lambda: probe.calls >= 3)
    assert monitor.readings == [READING]
    await monitor.stop()
    assert not monitor.running
    calls = probe.calls
    await asyncio.sleep(0.1)
    assert probe.calls == calls
    await monitor.stop()  # idempotent


@pytest.mark.asyncio
async def test_start_rejects_bad_interval() -> None:
    monitor = DeviceMonitor(ScriptedProbe([]))
    with pytest.raises(ValueError, match="interval"):
        await monitor.start(0)
    assert not monitor.running


@pytest.mark.asyncio
async def test_errors_are_counted_loop_survives_stale_readings_kept() -> None:
    probe = ScriptedProbe([READING], RuntimeError("boom"))
    monitor = DeviceMonitor(probe)
    await monitor.start(0.01)
    try:
        await wait_until(lambda: monitor.errors >= 3)
        assert monitor.running
    finally:
        await monitor.stop()
    assert monitor.readings == [READING]
    assert monitor.last_refresh_ok is False
    assert monitor.last_error == "RuntimeError: boom"


@pytest.mark.asyncio
async def test_recovers_after_errors() -> None:
    monitor = DeviceMonitor(ScriptedProbe(RuntimeError("down"), [READING]))
    assert await monitor.refresh() is False
    assert await monitor.refresh() is True
    assert (monitor.errors, monitor.last_refresh_ok, monitor.readings) == (1, True, [READING])


@pytest.mark.asyncio
async def test_slow_probe_is_bounded_by_monitor_timeout() -> None:
    monitor = DeviceMonitor(ScriptedProbe([READING], delay=30), timeout=0.1)
    start = time.monotonic()
    assert await monitor.refresh() is False
    assert time.monotonic() - start < 5
    assert monitor.errors == 1
    assert monitor.last_error is not None and "timed out" in monitor.last_error


@pytest.mark.asyncio
async def test_hanging_npu_smi_counts_errors_without_hanging(make_script: Script) -> None:
    monitor = DeviceMonitor(NpuSmiProbe(str(make_script("exec sleep 30")), timeout=0.3), timeout=5)
    await monitor.start(0.05)
    try:
        await wait_until(lambda: monitor.errors >= 2, timeout=10)
    finally:
        await monitor.stop()
    assert monitor.readings == []
    assert monitor.last_error is not None and "timed out after 0.3s" in monitor.last_error
    assert scrape(monitor)["npugw_device_probe_errors_total"][0][1] == monitor.errors


@pytest.mark.asyncio
async def test_failing_npu_smi_error_text_counted(make_script: Script, fixture_dir: Path) -> None:
    script = make_script(f'cat "{fixture_dir / F_ERR_8005}"\nexit 1')
    monitor = DeviceMonitor(NpuSmiProbe(str(script)))
    assert await monitor.refresh() is False
    assert monitor.errors == 1
    assert monitor.last_error is not None and "ret is -8005" in monitor.last_error
    samples = scrape(monitor)
    assert samples["npugw_device_probe_up"] == [({}, 0.0)]
    assert "npugw_device_probe_last_success_timestamp_seconds" not in samples


@pytest.mark.asyncio
async def test_alert_ratio_from_exported_npu_memory(cat_fixture_script: Script) -> None:
    monitor = DeviceMonitor(NpuSmiProbe(str(cat_fixture_script(F_910B2C_16))))
    assert await monitor.refresh()
    samples = scrape(monitor)
    used = by_device(samples, "npu_memory_usage_bytes", type="used")
    total = by_device(samples, "npu_memory_usage_bytes", type="total")
    assert sorted(used, key=int) == [str(i) for i in range(16)]
    ratio = {d: used[d] / total[d] for d in used}
    # npu_memory_usage_bytes{type="used"} / npu_memory_usage_bytes{type="total"} > 0.8
    assert ratio["0"] == pytest.approx(59356 / 65536)
    assert ratio["4"] == pytest.approx(59346 / 65536)
    assert all(r > 0.8 for r in ratio.values())
    assert used["0"] == 59356 * MIB
    assert by_device(samples, "npu_health") == {str(i): 1.0 for i in range(16)}
    assert by_device(samples, "npugw_device_memory_bytes", kind="npu", type="total")["15"] == 65536 * MIB
    assert samples["npugw_device_probe_errors_total"] == [({}, 0.0)]
    assert samples["npugw_device_probe_up"] == [({}, 1.0)]


@pytest.mark.asyncio
async def test_alert_ratio_below_threshold_and_a3_aicore(cat_fixture_script: Script) -> None:
    low = DeviceMonitor(NpuSmiProbe(str(cat_fixture_script(F_910B1))))
    assert await low.refresh()
    s = scrape(low)
    used = by_device(s, "npu_memory_usage_bytes", type="used")
    total = by_device(s, "npu_memory_usage_bytes", type="total")
    assert used["2"] / total["2"] == pytest.approx(3376 / 65536)
    assert not any(used[d] / total[d] > 0.8 for d in used)
    a3 = DeviceMonitor(NpuSmiProbe(str(cat_fixture_script(F_A3))))
    assert await a3.refresh()
    aicore = by_device(scrape(a3), "npu_aicore_utilization_percent")
    assert len(aicore) == 16
    assert (aicore["8"], aicore["12"], aicore["0"]) == (8.0, 6.0, 7.0)


@pytest.mark.asyncio
async def test_alarm_health_exports_zero(cat_fixture_script: Script) -> None:
    monitor = DeviceMonitor(NpuSmiProbe(str(cat_fixture_script(F_310B4))))
    assert await monitor.refresh()
    samples = scrape(monitor)
    assert by_device(samples, "npu_health") == {"0": 0.0}
    assert by_device(samples, "npu_memory_usage_bytes", type="used") == {"0": 3628.0 * MIB}


@pytest.mark.asyncio
async def test_cpu_box_exports_generic_memory_only() -> None:
    monitor = DeviceMonitor(CpuProbe(), clock=lambda: 99.0)
    assert await monitor.refresh()
    samples = scrape(monitor)
    assert "npu_memory_usage_bytes" not in samples
    cpu_used = by_device(samples, "npugw_device_memory_bytes", kind="cpu", type="used")
    cpu_total = by_device(samples, "npugw_device_memory_bytes", kind="cpu", type="total")
    assert cpu_total["0"] > cpu_used["0"] > 0
    rss = by_device(samples, "npugw_device_memory_bytes", kind="process", type="used")
    assert rss["gateway"] > 0
    assert "0" in by_device(samples, "npugw_device_utilization_percent", kind="cpu")
    assert samples["npugw_device_probe_last_success_timestamp_seconds"] == [({}, 99.0)]


@pytest.mark.asyncio
async def test_scrape_never_calls_the_probe() -> None:
    dup = DeviceReading("npu", "0", 20, 100, health="OK")
    probe = ScriptedProbe([READING, dup])
    monitor = DeviceMonitor(probe)
    assert await monitor.refresh()
    samples = scrape(monitor)
    samples = scrape(monitor)
    assert probe.calls == 1
    # the duplicate (kind, device) is dropped, the first reading wins
    assert by_device(samples, "npu_memory_usage_bytes", type="used") == {"0": 10.0}


def test_collector_registers_once_per_registry() -> None:
    registry = CollectorRegistry()
    monitor = DeviceMonitor(ScriptedProbe([]))
    registry.register(DeviceCollector(monitor))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(DeviceCollector(monitor))


def test_monitor_rejects_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        DeviceMonitor(ScriptedProbe([]), timeout=0)


@pytest.mark.asyncio
async def test_repeated_failure_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    monitor = DeviceMonitor(ScriptedProbe(RuntimeError("a"), RuntimeError("a"), RuntimeError("b"), [READING]))
    with caplog.at_level(logging.DEBUG, logger="engine_adapter.devices.monitor"):
        for _ in range(4):
            await monitor.refresh()
    levels = [(r.levelno, r.getMessage().rsplit(": ", 1)[-1]) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "a"),
        (logging.DEBUG, "a"),
        (logging.WARNING, "b"),
        (logging.INFO, "device probe ScriptedProbe recovered"),
    ]
    assert monitor.errors == 3
