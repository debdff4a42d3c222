"""Device detection and probes: npu-smi run for real against scripts, psutil for real."""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from engine_adapter.devices import (
    CompositeProbe,
    CpuProbe,
    CudaProbe,
    DeviceReading,
    NpuSmiError,
    NpuSmiProbe,
    TorchNpuProbe,
    detect_device,
    make_probe,
)
from engine_adapter.devices import probes as probes_mod

MIB = 1024 * 1024
Script = Callable[[str], Path]
F_910B1 = "910b1_8npu_24.1.0_procs_vllm-ascend-312.txt"
F_A3 = "a3_910_93_16chip_25.2.0_procs_vllm-ascend-3002.txt"
F_DUO = "310p3_300iduo_4card_25.3.rc1_procs_vllm-ascend-6063.txt"
F_ERR_8005 = "error_dcmi_init_-8005_vllm-ascend-2698.txt"
F_ERR_8020 = "error_device_used_-8020_cann-container-image-46.txt"


# -- detect_device -------------------------------------------------------------


@pytest.fixture
def bare_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No npu-smi / nvidia-smi on PATH, no /dev/davinci0, torch says no CUDA."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.delenv("NPUGW_DEVICE", raising=False)
    monkeypatch.setattr(probes_mod, "DAVINCI_DEVICE", tmp_path / "no-davinci0")
    monkeypatch.setattr(probes_mod, "_torch_cuda_available", lambda: False)
    return bindir


def _exe(path: Path) -> None:
    path.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    path.chmod(0o755)


def test_detect_cpu_on_bare_host(bare_host: Path) -> None:
    assert detect_device() == "cpu"


def test_detect_npu_from_npu_smi_on_path(bare_host: Path) -> None:
    _exe(bare_host / "npu-smi")
    assert detect_device() == "npu"


def test_detect_npu_from_davinci_device(bare_host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "davinci0"
    dev.touch()
    monkeypatch.setattr(probes_mod, "DAVINCI_DEVICE", dev)
    assert detect_device() == "npu"


def test_detect_cuda_from_nvidia_smi(bare_host: Path) -> None:
    _exe(bare_host / "nvidia-smi")
    assert detect_device() == "cuda"


def test_detect_cuda_from_torch(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes_mod, "_torch_cuda_available", lambda: True)
    assert detect_device() == "cuda"


def test_npu_wins_over_cuda(bare_host: Path) -> None:
    _exe(bare_host / "npu-smi")
    _exe(bare_host / "nvidia-smi")
    assert detect_device() == "npu"


@pytest.mark.parametrize(("value", "expected"), [("npu", "npu"), ("CUDA", "cuda"), (" cpu ", "cpu")])
def test_detect_env_override(bare_host: Path, monkeypatch: pytest.MonkeyPatch, value: str, expected: str) -> None:
    _exe(bare_host / "nvidia-smi")
    monkeypatch.setenv("NPUGW_DEVICE", value)
    assert detect_device() == expected


def test_detect_env_auto_and_mapping(bare_host: Path) -> None:
    _exe(bare_host / "npu-smi")
    assert detect_device({"NPUGW_DEVICE": "auto", "PATH": str(bare_host)}) == "npu"
    assert detect_device({"NPUGW_DEVICE": "cpu", "PATH": str(bare_host)}) == "cpu"
    assert detect_device({"PATH": "/nonexistent"}) == "cpu"


def test_detect_env_invalid(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUGW_DEVICE", "tpu")
    with pytest.raises(ValueError, match="tpu"):
        detect_device()


def test_detection_never_imports_torch_npu() -> None:
    assert probes_mod._module_available("torch_npu") is False  # not installed on this host
    detect_device({"NPUGW_DEVICE": "auto"})
    assert "torch_npu" not in sys.modules


def test_torch_cuda_check_matches_torch() -> None:
    import torch  # heavy; only this test needs it

    assert probes_mod._torch_cuda_available() is bool(torch.cuda.is_available())


# -- NpuSmiProbe ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_npu_smi_probe_reads_script(cat_fixture_script: Script) -> None:
    probe = NpuSmiProbe(str(cat_fixture_script(F_910B1)), timeout=10)
    readings = await probe.read()
    assert [r.device for r in readings] == [str(i) for i in range(8)]
    r0 = readings[0]
    assert (r0.kind, r0.used_bytes, r0.total_bytes) == ("npu", 3437 * MIB, 65536 * MIB)
    assert (r0.utilization, r0.health) == (0.0, "OK")
    chips = await probe.read_chips()
    assert chips[0].processes[0].pid == 641248


@pytest.mark.asyncio
async def test_npu_smi_probe_labels_a3_and_duo(cat_fixture_script: Script) -> None:
    a3 = await NpuSmiProbe(str(cat_fixture_script(F_A3))).read()
    assert [r.device for r in a3] == [str(i) for i in range(16)]
    assert a3[15].used_bytes == 61631 * MIB
    assert a3[0].utilization == 7.0
    duo = await NpuSmiProbe(str(cat_fixture_script(F_DUO))).read()
    assert [r.device for r in duo] == [str(i) for i in range(8)]
    assert (duo[1].used_bytes, duo[1].total_bytes) == (35270 * MIB, 43693 * MIB)


@pytest.mark.asyncio
async def test_npu_smi_probe_passes_args(make_script: Script, fixture_dir: Path) -> None:
    usages = fixture_dir / "usages_910b1_-t_usages_-i_0_arthurchiao-blog.txt"
    script = make_script(f'[ "$*" = "info -t usages -i 0" ] && exec cat "{usages}"\nexit 3')
    out = await NpuSmiProbe(str(script), args=("info", "-t", "usages", "-i", "0")).run()
    assert "HBM Usage Rate(%)" in out
    with pytest.raises(NpuSmiError, match="status 3"):
        await NpuSmiProbe(str(script)).run()


@pytest.mark.asyncio
async def test_npu_smi_probe_timeout_kills(make_script: Script, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script = make_script(f'echo $$ > "{pidfile}"\nexec sleep 30')
    probe = NpuSmiProbe(str(script), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(NpuSmiError, match="timed out"):
        await probe.read()
    assert time.monotonic() - start < 5
    pid = int(pidfile.read_text())
    assert not psutil.pid_exists(pid)


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.asyncio
async def test_npu_smi_probe_timeout_kills_grandchildren(make_script: Script, tmp_path: Path) -> None:
    pidfile = tmp_path / "child-pid"
    script = make_script(f'sleep 30 &\necho $! > "{pidfile}"\nwait')
    with pytest.raises(NpuSmiError, match="timed out"):
        await NpuSmiProbe(str(script), timeout=0.5).read()
    pid = int(pidfile.read_text())
    for _ in range(200):
        if _gone(pid):
            break
        await asyncio.sleep(0.01)
    assert _gone(pid), "npu-smi's own child survived the timeout kill"


@pytest.mark.asyncio
async def test_npu_smi_probe_cancel_kills(make_script: Script, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script = make_script(f'echo $$ > "{pidfile}"\nexec sleep 30')
    task = asyncio.create_task(NpuSmiProbe(str(script), timeout=20).read())
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not psutil.pid_exists(int(pidfile.read_text()))


@pytest.mark.asyncio
async def test_npu_smi_probe_nonzero_exit_with_dcmi_error(make_script: Script, fixture_dir: Path) -> None:
    script = make_script(f'cat "{fixture_dir / F_ERR_8005}"\nexit 255')
    with pytest.raises(NpuSmiError, match=r"status 255.*ret is -8005") as info:
        await NpuSmiProbe(str(script)).read()
    assert info.value.code == -8005


@pytest.mark.asyncio
async def test_npu_smi_probe_error_on_stderr(make_script: Script, fixture_dir: Path) -> None:
    script = make_script(f'cat "{fixture_dir / F_ERR_8020}" >&2\nexit 1')
    with pytest.raises(NpuSmiError) as info:
        await NpuSmiProbe(str(script)).read()
    assert info.value.code == -8020


@pytest.mark.asyncio
async def test_npu_smi_probe_exit_zero_with_error_text(cat_fixture_script: Script) -> None:
    with pytest.raises(NpuSmiError) as info:
        await NpuSmiProbe(str(cat_fixture_script(F_ERR_8020))).read()
    assert info.value.code == -8020


@pytest.mark.asyncio
async def test_npu_smi_probe_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(NpuSmiError, match="cannot run"):
        await NpuSmiProbe(str(tmp_path / "no-such-npu-smi")).read()


def test_npu_smi_probe_rejects_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        NpuSmiProbe(timeout=0)


# -- CpuProbe ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cpu_probe_plausible() -> None:
    system, tree = await CpuProbe().read()
    vm_total = psutil.virtual_memory().total
    assert (system.kind, system.device) == ("cpu", "0")
    assert system.total_bytes == vm_total
    assert system.total_bytes > system.used_bytes > 0
    assert system.utilization is not None and 0.0 <= system.utilization <= 100.0
    assert (tree.kind, tree.device) == ("process", "gateway")
    own_rss = psutil.Process().memory_info().rss
    assert tree.total_bytes > tree.used_bytes >= own_rss // 2 > 0


@pytest.mark.asyncio
async def test_cpu_probe_counts_child_processes() -> None:
    probe = CpuProbe()
    code = (
        "import time; b = bytearray(96 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
        "print('up', flush=True); time.sleep(30)"
    )
    before = (await probe.read())[1].used_bytes
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert await asyncio.wait_for(child.stdout.readline(), 30) == b"up\n"
        after = (await probe.read())[1].used_bytes
    finally:
        child.kill()
        await child.wait()
    assert after - before > 64 * MIB


# -- torch-based probes (fake torch modules: no NPU / GPU on this host) ------------


def _fake_module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _fake_backend(free_total: list[tuple[int, int]]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: len(free_total),
        mem_get_info=lambda i: free_total[i],
    )


def test_torch_npu_probe_needs_torch_npu() -> None:
    with pytest.raises(RuntimeError, match="torch_npu"):
        TorchNpuProbe([0])


@pytest.mark.asyncio
async def test_torch_npu_probe_with_fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = _fake_backend([(10 * MIB, 64 * MIB), (60 * MIB, 64 * MIB)])
    monkeypatch.setitem(sys.modules, "torch", _fake_module("torch", npu=npu))
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_module("torch_npu"))
    readings = await TorchNpuProbe([1]).read()  # only the device it is given: a context costs HBM
    assert readings == [DeviceReading("npu", "1", 4 * MIB, 64 * MIB)]


@pytest.mark.asyncio
async def test_cuda_probe_with_fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _fake_backend([(1 * MIB, 80 * MIB)])
    monkeypatch.setitem(sys.modules, "torch", _fake_module("torch", cuda=cuda))
    assert await CudaProbe().read() == [DeviceReading("cuda", "0", 79 * MIB, 80 * MIB)]


@pytest.mark.asyncio
async def test_cuda_probe_real_torch() -> None:
    import torch  # heavy; only this test needs it

    readings = await CudaProbe().read()
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(readings) == expected
    assert all(r.total_bytes >= r.used_bytes >= 0 for r in readings)


# -- make_probe ----------------------------------------------------------------


def test_make_probe_kinds(cat_fixture_script: Script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_probe("cpu"), CpuProbe)
    assert isinstance(make_probe("cuda"), CudaProbe)
    script = cat_fixture_script(F_910B1)
    npu = make_probe("npu", str(script), timeout=3)
    assert isinstance(npu, NpuSmiProbe)
    assert (npu.executable, npu.timeout) == (str(script), 3)
    missing = make_probe("npu", str(tmp_path / "missing"))  # no torch_npu here either
    assert isinstance(missing, NpuSmiProbe)
    # torch_npu importable: still npu-smi, never an NPU context on every device from the gateway process
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_module("torch_npu"))
    assert isinstance(make_probe("npu", str(tmp_path / "missing")), NpuSmiProbe)
    monkeypatch.setenv("NPUGW_DEVICE", "cpu")
    assert isinstance(make_probe("auto"), CpuProbe)
    with pytest.raises(ValueError, match="tpu"):
        make_probe("tpu")


@pytest.mark.asyncio
async def test_make_probe_include_host(cat_fixture_script: Script) -> None:
    probe = make_probe("npu", str(cat_fixture_script(F_910B1)), include_host=True)
    assert isinstance(probe, CompositeProbe)
    readings = await probe.read()
    assert [r.kind for r in readings] == ["npu"] * 8 + ["cpu", "process"]
