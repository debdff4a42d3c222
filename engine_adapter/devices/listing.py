"""The accelerators this host has, as a list of devices, for placing engines
(engine_adapter/placement.py) and for `npu-gateway plan`.

NPUs come from `npu-smi info`, GPUs from `nvidia-smi`; neither needs torch,
torch_npu or an NPU context, so the list works on a login node and in tests
(a fake `npu-smi` on PATH, or a recorded output file).

Each device has a `name`, the id npu-smi prints and the `device` label of
`npu_memory_usage_bytes` (NPU id on 910/910B, Phy-ID on A3, Device on 310P),
and an `index`, its position in npu-smi's list: the logical id that
`ASCEND_RT_VISIBLE_DEVICES` takes. On a host both are 0..N-1; in a container
given /dev/davinci3 and /dev/davinci5, npu-smi prints 3 and 5 while the
runtime numbers them 0 and 1.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .npu_smi import NpuSmiError, parse_npu_smi_info
from .probes import npu_device_label

NPU_VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
GPU_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class DeviceListError(RuntimeError):
    """The device list cannot be read: the tool is missing, failed, timed out,
    or printed something this gateway does not understand. The message names
    the command and the first line of its output."""


@dataclass(frozen=True, slots=True)
class Device:
    name: str  # as npu-smi / nvidia-smi print it; the metrics' `device` label
    index: int  # logical id: what ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES take


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "(no output)")[:160]


def _run(argv: Sequence[str], timeout: float) -> str:
    cmd = " ".join(argv)
    try:
        done = subprocess.run(  # argv from our own settings, no shell
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise DeviceListError(f"`{cmd}`: {argv[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise DeviceListError(f"`{cmd}` did not finish within {timeout:g}s") from None
    except OSError as e:
        raise DeviceListError(f"`{cmd}` cannot run: {e.strerror or e}") from None
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        both = out + "\n" + done.stderr.decode("utf-8", "replace")
        raise DeviceListError(f"`{cmd}` failed (exit status {done.returncode}): {_first_line(both)}")
    return out


def npus_from_text(text: str, source: str = "npu-smi info") -> list[Device]:
    """The devices of one `npu-smi info` output, in its order."""
    try:
        chips = parse_npu_smi_info(text)
    except NpuSmiError as e:
        raise DeviceListError(
            f"`{source}` printed output this gateway cannot read ({e}); its first line: {_first_line(text)!r}"
        ) from None
    if not chips:
        raise DeviceListError(f"`{source}` lists no NPU; its first line: {_first_line(text)!r}")
    names = [npu_device_label(c) for c in chips]
    if len(set(names)) != len(names):
        raise DeviceListError(f"`{source}` lists a device id twice: {', '.join(names)}")
    return [Device(name, i) for i, name in enumerate(names)]


def list_npus(executable: str = "npu-smi", *, output_file: Path | None = None, timeout: float = 20.0) -> list[Device]:
    """The NPUs `npu-smi info` lists (or the recorded output in `output_file`)."""
    if output_file is not None:
        try:
            text = output_file.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise DeviceListError(f"cannot read the npu-smi output file {output_file}: {e.strerror or e}") from None
        return npus_from_text(text, f"npu-smi info (recorded in {output_file})")
    return npus_from_text(_run([executable, "info"], timeout), f"{executable} info")


def list_gpus(executable: str = "nvidia-smi", *, timeout: float = 20.0) -> list[Device]:
    """The GPUs `nvidia-smi --query-gpu=index` lists (PCI bus order, the order
    CUDA_VISIBLE_DEVICES follows with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    argv = [executable, "--query-gpu=index", "--format=csv,noheader"]
    text = _run(argv, timeout)
    rows = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not rows or not all(r.isdigit() for r in rows):
        raise DeviceListError(f"`{' '.join(argv)}` printed no GPU index list; its first line: {_first_line(text)!r}")
    return [Device(r, int(r)) for r in rows]


def visible_subset(devices: Sequence[Device], env_var: str, environ: Mapping[str, str]) -> list[Device]:
    """The devices a `*_VISIBLE_DEVICES` the gateway was started with leaves
    (logical ids, as the runtime reads it); all of them when it is unset."""
    raw = environ.get(env_var, "").strip()
    if not raw:
        return list(devices)
    by_index = {d.index: d for d in devices}
    out: list[Device] = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) not in by_index:
            raise DeviceListError(
                f"{env_var}={raw!r} names {part!r}, which is not a logical id of the "
                f"{len(devices)} listed devices (0-{len(devices) - 1})"
            )
        out.append(by_index[int(part)])
    return out
