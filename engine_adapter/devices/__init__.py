"""Device probes: what accelerator is here, and how much of its memory is used.

`npu_smi` parses Ascend `npu-smi` output, `probes` reads NPU / CUDA / CPU memory
without blocking the event loop, `monitor` caches readings in the background
and exports them to Prometheus, `listing` lists the devices engines can be
placed on.
"""

from .listing import Device, DeviceListError, list_gpus, list_npus, npus_from_text, visible_subset
from .monitor import DeviceCollector, DeviceMonitor
from .npu_smi import (
    NpuChip,
    NpuProcess,
    NpuSmiError,
    npu_smi_error_from_text,
    parse_npu_smi_info,
    parse_npu_smi_sections,
    parse_npu_smi_usages,
    parse_npu_smi_version,
)
from .probes import (
    DEVICE_ENV,
    CompositeProbe,
    CpuProbe,
    CudaProbe,
    DeviceKind,
    DeviceProbe,
    DeviceReading,
    NpuSmiProbe,
    TorchNpuProbe,
    detect_device,
    make_probe,
    npu_device_label,
    readings_from_chips,
)

__all__ = [
    "DEVICE_ENV",
    "CompositeProbe",
    "CpuProbe",
    "CudaProbe",
    "Device",
    "DeviceCollector",
    "DeviceKind",
    "DeviceListError",
    "DeviceMonitor",
    "DeviceProbe",
    "DeviceReading",
    "NpuChip",
    "NpuProcess",
    "NpuSmiError",
    "NpuSmiProbe",
    "TorchNpuProbe",
    "detect_device",
    "list_gpus",
    "list_npus",
    "make_probe",
    "npu_device_label",
    "npu_smi_error_from_text",
    "npus_from_text",
    "parse_npu_smi_info",
    "parse_npu_smi_sections",
    "parse_npu_smi_usages",
    "parse_npu_smi_version",
    "readings_from_chips",
    "visible_subset",
]
