"""Device detection and memory probes (Ascend NPU, CUDA, CPU).

Every probe's `read()` is a coroutine that keeps blocking work off the event
loop: `npu-smi` runs as an asyncio subprocess, torch and psutil calls run in a
worker thread (`asyncio.to_thread`).

torch / torch_npu are imported lazily and only inside probes that need them:
`import torch_npu` breaks torch on hosts without CANN, so detection only asks
`importlib.util.find_spec`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import psutil  # type: ignore[import-untyped, unused-ignore]

from .npu_smi import NpuChip, NpuSmiError, npu_smi_error_from_text, parse_npu_smi_info

logger = logging.getLogger(__name__)

DeviceKind = Literal["npu", "cuda", "cpu"]
DEVICE_ENV = "NPUGW_DEVICE"
DAVINCI_DEVICE = Path("/dev/davinci0")
_KINDS: tuple[DeviceKind, ...] = ("npu", "cuda", "cpu")


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """Memory (bytes) of one device at one moment.

    `utilization` is a percentage (AI Core % on NPU, system CPU % on CPU) when the
    probe knows it; `health` is npu-smi's Health text (`OK`, `Alarm`, ...).
    """

    kind: str
    device: str
    used_bytes: int
    total_bytes: int
    utilization: float | None = None
    health: str | None = None


class DeviceProbe(Protocol):
    """Something that can read the current device readings."""

    async def read(self) -> list[DeviceReading]: ...


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _torch_cuda_available() -> bool:
    if not _module_available("torch"):
        return False
    try:
        torch = importlib.import_module("torch")
        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install must not break detection
        logger.debug("torch.cuda.is_available() failed", exc_info=True)
        return False


def detect_device(environ: Mapping[str, str] | None = None) -> DeviceKind:
    """Which accelerator this host has: "npu", "cuda" or "cpu".

    `NPUGW_DEVICE` (npu / cuda / cpu; empty or "auto" means detect) overrides.
    NPU: `npu-smi` on PATH, `/dev/davinci0` present or `torch_npu` importable
    (never imported here). CUDA: `nvidia-smi` on PATH or torch reports CUDA.
    """
    env = os.environ if environ is None else environ
    override = env.get(DEVICE_ENV, "").strip().lower()
    if override and override != "auto":
        for kind in _KINDS:
            if override == kind:
                return kind
        raise ValueError(f"{DEVICE_ENV}={override!r}: expected one of npu, cuda, cpu, auto")
    path = env.get("PATH")
    if shutil.which("npu-smi", path=path) or DAVINCI_DEVICE.exists() or _module_available("torch_npu"):
        return "npu"
    if shutil.which("nvidia-smi", path=path) or _torch_cuda_available():
        return "cuda"
    return "cpu"


def npu_device_label(chip: NpuChip) -> str:
    """The `device` label of a chip: its logical/physical id where npu-smi shows one
    (A3 Phy-ID, 310P Device), else the NPU id (`npu-chip` for extra chips)."""
    if chip.device_id is not None:
        return str(chip.device_id)
    return str(chip.npu_id) if chip.chip_id == 0 else f"{chip.npu_id}-{chip.chip_id}"


def readings_from_chips(chips: Sequence[NpuChip]) -> list[DeviceReading]:
    out: list[DeviceReading] = []
    for chip in chips:
        used, total = chip.memory_bytes()
        out.append(
            DeviceReading(
                kind="npu",
                device=npu_device_label(chip),
                used_bytes=used,
                total_bytes=total,
                utilization=chip.aicore_percent,
                health=chip.health,
            )
        )
    return out


class NpuSmiProbe:
    """Runs `npu-smi info` and parses it; the process is killed after `timeout` s."""

    def __init__(
        self, executable: str = "npu-smi", *, timeout: float = 10.0, args: Sequence[str] = ("info",)
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.executable = executable
        self.args = tuple(args)
        self.timeout = timeout

    async def run(self) -> str:
        """Raw stdout of one npu-smi run; NpuSmiError on spawn failure, timeout, exit != 0."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.executable,
                *self.args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # so a timeout kills npu-smi and anything it spawned
            )
        except OSError as e:
            raise NpuSmiError(f"cannot run {self.executable!r}: {e}") from e
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
            await _kill(proc)
            raise NpuSmiError(f"{self.executable} timed out after {self.timeout:g}s") from None
        except BaseException:
            await _kill(proc)  # cancelled: do not leave npu-smi running
            raise
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            both = text + "\n" + err.decode("utf-8", "replace")
            cause = npu_smi_error_from_text(both)
            raise NpuSmiError(f"{self.executable} exited with status {proc.returncode}: {cause}", cause.code)
        return text

    async def read_chips(self) -> list[NpuChip]:
        return parse_npu_smi_info(await self.run())

    async def read(self) -> list[DeviceReading]:
        return readings_from_chips(await self.read_chips())


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), 5.0)


class TorchNpuProbe:
    """`torch.npu.mem_get_info()` on the given NPUs, in a worker thread.

    This opens an NPU context (device memory) in the calling process on each
    device it reads, so make_probe never picks it for the gateway process:
    give it only the devices a process already uses (`devices`: torch's
    logical ids; labels are those ids, not npu-smi's physical ones).
    """

    def __init__(self, devices: Sequence[int]) -> None:
        if not _module_available("torch_npu"):
            raise RuntimeError("torch_npu is not importable; use NpuSmiProbe")
        self.devices = tuple(devices)

    async def read(self) -> list[DeviceReading]:
        return await asyncio.to_thread(self._read_sync)

    def _read_sync(self) -> list[DeviceReading]:
        torch = importlib.import_module("torch")
        importlib.import_module("torch_npu")  # registers torch.npu
        out: list[DeviceReading] = []
        for i in self.devices:
            free, total = torch.npu.mem_get_info(i)
            out.append(DeviceReading("npu", str(i), int(total) - int(free), int(total)))
        return out


class CudaProbe:
    """`torch.cuda.mem_get_info()` per visible GPU, in a worker thread.

    Note: this creates a CUDA context in the calling process.
    """

    async def read(self) -> list[DeviceReading]:
        return await asyncio.to_thread(self._read_sync)

    @staticmethod
    def _read_sync() -> list[DeviceReading]:
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():
            return []
        out: list[DeviceReading] = []
        for i in range(int(torch.cuda.device_count())):
            free, total = torch.cuda.mem_get_info(i)
            out.append(DeviceReading("cuda", str(i), int(total) - int(free), int(total)))
        return out


class CpuProbe:
    """Host memory, via psutil, in a worker thread.

    Two readings: kind="cpu", device="0": system memory in use (total - available)
    of total, with system CPU % as utilization; kind="process", device="gateway":
    summed RSS of this process and all its descendants (vLLM EngineCore workers),
    against system total. RSS of processes sharing pages is over-counted.
    """

    def __init__(self, pid: int | None = None) -> None:
        self._proc = psutil.Process(pid)
        psutil.cpu_percent(interval=None)  # first call only primes the counter

    async def read(self) -> list[DeviceReading]:
        return await asyncio.to_thread(self._read_sync)

    def _tree_rss(self) -> int:
        total = 0
        procs = [self._proc]
        with contextlib.suppress(psutil.Error):
            procs.extend(self._proc.children(recursive=True))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    def _read_sync(self) -> list[DeviceReading]:
        vm = psutil.virtual_memory()
        total = int(vm.total)
        used = total - int(vm.available)
        cpu = float(psutil.cpu_percent(interval=None))
        return [
            DeviceReading("cpu", "0", used, total, utilization=cpu),
            DeviceReading("process", "gateway", self._tree_rss(), total),
        ]


class CompositeProbe:
    """Concatenates the readings of several probes; fails if any of them fails."""

    def __init__(self, probes: Sequence[DeviceProbe]) -> None:
        self.probes = tuple(probes)

    async def read(self) -> list[DeviceReading]:
        results = await asyncio.gather(*(p.read() for p in self.probes))
        return [r for rs in results for r in rs]


def make_probe(
    device: str,
    npu_smi_path: str = "npu-smi",
    *,
    timeout: float = 10.0,
    include_host: bool = False,
) -> DeviceProbe:
    """Probe for `device` ("npu", "cuda", "cpu" or "auto" = detect_device()).

    NPU: npu-smi, always. Without it the probe's errors show in the monitor
    (`npugw_device_probe_up` 0); torch_npu is not a fallback, since it would
    open an NPU context on every device from the gateway process.
    `include_host` adds the CpuProbe readings to an accelerator probe.
    """
    kind = detect_device() if device == "auto" else device
    probe: DeviceProbe
    if kind == "npu":
        if shutil.which(npu_smi_path) is None:
            logger.warning("%s not found: no NPU memory metrics (mount npu-smi into the container)", npu_smi_path)
        probe = NpuSmiProbe(npu_smi_path, timeout=timeout)
    elif kind == "cuda":
        probe = CudaProbe()
    elif kind == "cpu":
        return CpuProbe()
    else:
        raise ValueError(f"unknown device {device!r}: expected npu, cuda, cpu or auto")
    return CompositeProbe([probe, CpuProbe()]) if include_host else probe
