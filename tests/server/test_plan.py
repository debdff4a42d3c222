"""`npu-gateway plan`, `--devices` and the refusal at start (issue 33), with
the recorded npu-smi outputs: a fake `npu-smi` on PATH that prints one, or
`plan --npu-smi-output FILE`."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import main
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"
F_910B_8 = FIXTURES / "910b1_8npu_24.1.0_procs_vllm-ascend-312.txt"
F_A3 = FIXTURES / "a3_910_93_16chip_25.2.0_procs_vllm-ascend-3002.txt"
F_DCMI = FIXTURES / "error_dcmi_init_-8005_vllm-ascend-2698.txt"


def fake_npu_smi(bin_dir: Path, fixture: Path, status: int = 0) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "npu-smi"
    script.write_text(f"#!/bin/sh\ncat {shlex.quote(str(fixture))}\nexit {status}\n", encoding="utf-8")
    script.chmod(0o755)


@pytest.fixture
def npu_smi_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    fake_npu_smi(bin_dir, F_910B_8)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    return bin_dir


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


def rows(out: str) -> dict[str, list[str]]:
    """ENGINE -> [MODEL, DEVICES, MEMORY, ENVIRONMENT] of the plan's table."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ENGINE"))
    table = {}
    for ln in lines[start + 1:]:
        if ln.startswith(("devices no engine", "ASCEND_RT", "CUDA_", "every engine")):
            break
        cells = ln.split(None, 4)
        table[cells[0]] = cells[1:]
    return table


def test_plan_from_a_recorded_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "--npu-smi-output", str(F_910B_8), "--tensor-parallel-size", "2",
                          "--extra-model", "qwen7b=/models/q7;devices=4,5")
    assert (code, err) == (0, "")
    table = rows(out)
    assert table["SmolLM2-135M-Instruct/0"] == ["embedded", "0,1", "0.90", "ASCEND_RT_VISIBLE_DEVICES=0,1"]
    assert table["qwen7b/0"] == ["/models/q7", "4,5", "0.90", "ASCEND_RT_VISIBLE_DEVICES=4,5"]
    assert table["all-MiniLM-L6-v2/0"] == ["embedded", "2", "0.05", "ASCEND_RT_VISIBLE_DEVICES=2"]
    assert "devices no engine uses: 3,6,7" in out


def test_plan_runs_npu_smi_on_path_and_honours_devices(
    npu_smi_on_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = plan(capsys, "--device", "npu", "--devices", "4,5,6", "--tensor-parallel-size", "2")
    assert code == 0
    assert "listed by npu-smi info: 0,1,2,3,4,5,6,7; the engines may use: 4,5,6" in out
    table = rows(out)
    assert table["SmolLM2-135M-Instruct/0"][1:3] == ["4,5", "0.90"]
    assert table["all-MiniLM-L6-v2/0"][1] == "6"


@pytest.mark.parametrize("argv, error", [
    (["--devices", "3,8"], "device 8 is not one the host lists"),
    (["--devices", "3,3"], "device 3 is given twice"),
    (["--num-workers", "5", "--tensor-parallel-size", "2"], "need 10 devices"),
    (["--devices", "0,1,2,3", "--tensor-parallel-size", "2", "--extra-model", "b=/m;devices=1,2,3"],
     "does not divide its 3 devices"),
    (["--num-workers", "8", "--embedding-gpu-memory-utilization", "0.1"], "over 0.95"),
])
def test_plan_refuses_with_exit_2(
    npu_smi_on_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    code, out, err = plan(capsys, "--device", "npu", *argv)
    assert code == 2 and error in err and "Traceback" not in err and "ENGINE" not in out


def test_plan_npu_smi_failing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    fake_npu_smi(tmp_path / "bin", F_DCMI, status=255)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    code, _, err = plan(capsys, "--device", "npu")
    assert code == 2
    assert "`npu-smi info` failed (exit status 255): DrvMngGetConsoleLogLevel failed." in err


def test_plan_on_cpu_places_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--device", "cpu", "--embedding-model", "none")
    assert code == 0 and "device: cpu" in out and rows(out)["SmolLM2-135M-Instruct/0"][1] == "cpu"


def test_settings_devices_forms() -> None:
    assert Settings(devices=["0,1", "2"]).devices == ["0", "1", "2"]  # type: ignore[call-arg]
    assert Settings(devices="4, 5").devices == ["4", "5"]  # type: ignore[call-arg]
    s = Settings(extra_model=["b=/m;devices=6,7", "c=/n"])  # type: ignore[call-arg]
    assert s.extra_models() == [(("b",), "/m"), (("c",), "/n")]
    assert s.extra_model_devices() == [("6", "7"), None]
    with pytest.raises(ValueError, match="unknown option"):
        Settings(extra_model=["b=/m;gpus=1"])  # type: ignore[call-arg]


def test_model_specs_give_each_engine_its_devices(npu_smi_on_path: Path) -> None:
    from server.models_setup import engine_block_tokens, model_specs

    s = Settings(device="npu", num_workers=2, tensor_parallel_size=2)  # type: ignore[call-arg]
    gen, emb = model_specs(s)
    assert gen.vllm is not None and emb.vllm is not None
    assert [dict(gen.vllm.env_for(i))["ASCEND_RT_VISIBLE_DEVICES"] for i in (0, 1)] == ["0,1", "2,3"]
    assert dict(emb.vllm.env_for(0))["ASCEND_RT_VISIBLE_DEVICES"] == "4"
    assert engine_block_tokens(s) == 128  # vllm-ascend's KV block, whatever --block-size says
    assert engine_block_tokens(Settings(device="npu", block_size=16)) == 128  # type: ignore[call-arg]
    assert engine_block_tokens(Settings(device="cuda")) == 16  # type: ignore[call-arg]
    assert engine_block_tokens(Settings(device="cpu")) == 128  # type: ignore[call-arg]
    assert engine_block_tokens(Settings(backend="simulated")) == 16  # type: ignore[call-arg]


def test_model_specs_honour_an_extra_models_own_devices(npu_smi_on_path: Path, tmp_path: Path) -> None:
    from server.models_setup import model_specs

    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    s = Settings(device="npu", extra_model=[f"other={folder};devices=7"],  # type: ignore[call-arg]
                 embedding_model="none")
    gen, other = model_specs(s)
    assert gen.vllm is not None and other.vllm is not None
    assert dict(gen.vllm.env_for(0))["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert dict(other.vllm.env_for(0))["ASCEND_RT_VISIBLE_DEVICES"] == "7"


def test_serve_refuses_before_any_engine_starts(tmp_path: Path) -> None:
    """A real `npu-gateway serve` process: exit 2 in seconds, naming need and free, no traceback."""
    fake_npu_smi(tmp_path / "bin", F_A3)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "NPUGW_DATA_DIR": str(tmp_path / "data")}
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--device", "npu", "--num-workers", "5",
         "--tensor-parallel-size", "4", "--port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot place the engines: the engines need 20 devices" in done.stderr
    assert "16 are available (0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15)" in done.stderr
    assert "Traceback" not in done.stderr and "starting vLLM engine" not in done.stderr


def test_plan_imports_no_torch_vllm_or_torch_npu() -> None:
    code = (
        "import sys\nfrom server.cli import main\n"
        f"try:\n    main(['plan', '--npu-smi-output', {str(F_A3)!r}, '--num-workers', '2'])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('torch', 'torch_npu', 'vllm', 'vllm_ascend') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
