"""Start the device monitor chosen once at start-up and export it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from engine_adapter.devices import DeviceCollector, DeviceMonitor, make_probe
from server.settings import Settings


async def start_device_monitor(settings: Settings, registry: CollectorRegistry) -> DeviceMonitor:
    device = settings.device
    if settings.backend == "simulated" and device == "auto":
        device = "cpu"
    probe = make_probe(device, include_host=device != "cpu")
    monitor = DeviceMonitor(probe, timeout=max(1.0, settings.device_probe_interval * 2))
    await monitor.refresh()
    await monitor.start(settings.device_probe_interval)
    registry.register(DeviceCollector(monitor))
    return monitor
