"""deploy/docker/with-cann-env.sh on a fake CANN tree: it sources the three
scripts the CANN base image's ENTRYPOINT sources (toolkit, ascendnpu-ir,
NNAL with --cxx_abi), survives their errors, and leaves bishengir-compile
on PATH (issue 33, ASCEND-REVIEW D1)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

WRAPPER = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "with-cann-env.sh"

# What each fake script does: records that it ran (and its arguments), then
# fails the way the real ones can (an unset variable, a failing command, a
# non-zero return).
TOOLKIT = 'export FAKE_TOOLKIT=sourced\necho "$SOME_UNSET_VARIABLE" >/dev/null\nreturn 3\n'
IR = 'export FAKE_IR=sourced\nexport PATH="{bin}:$PATH"\n'
NNAL = 'export FAKE_ATB_ARGS="$*"\nfalse\nexport FAKE_ATB_AFTER_ERROR=yes\n'
REPORT = 'echo "$FAKE_TOOLKIT|$FAKE_IR|$FAKE_ATB_ARGS|$FAKE_ATB_AFTER_ERROR|$(command -v bishengir-compile)"'


def cann_tree(root: Path, *, ir: bool = True) -> Path:
    def write(rel: str, text: str, mode: int = 0o644) -> Path:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(mode)
        return path

    write("ascend-toolkit/set_env.sh", TOOLKIT)
    tool = write("cann-9.1.0/tools/bishengir/bin/bishengir-compile", "#!/bin/sh\necho bishengir\n", 0o755)
    if ir:
        write("cann-9.1.0/share/info/ascendnpu-ir/bin/set_env.sh", IR.format(bin=tool.parent))
    write("nnal/atb/set_env.sh", NNAL)
    return tool


def run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(WRAPPER), "sh", "-c", REPORT], capture_output=True, text=True, timeout=30,
        env={**os.environ, "ASCEND_ROOT": str(root), **env},
    )


def test_all_three_scripts_are_sourced_and_bishengir_compile_is_on_path(tmp_path: Path) -> None:
    tool = cann_tree(tmp_path)
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split("|") == ["sourced", "sourced", "--cxx_abi=1", "yes", str(tool)]
    assert "ascend-toolkit/set_env.sh returned 3 (continuing)" in r.stderr


@pytest.mark.parametrize("abi", ["0", "1"])
def test_nnal_gets_the_cxx_abi_of_atb_cxx_abi(tmp_path: Path, abi: str) -> None:
    cann_tree(tmp_path)
    r = run(tmp_path, ATB_CXX_ABI=abi)
    assert r.stdout.strip().split("|")[2] == f"--cxx_abi={abi}"


def test_a_missing_script_is_named_and_the_command_still_runs(tmp_path: Path) -> None:
    cann_tree(tmp_path, ir=False)
    r = run(tmp_path, PATH="/usr/bin:/bin")
    assert r.returncode == 0, r.stderr
    assert "ascendnpu-ir/bin/set_env.sh not found" in r.stderr
    assert r.stdout.strip().split("|")[:2] == ["sourced", ""]
