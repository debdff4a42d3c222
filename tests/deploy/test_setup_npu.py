"""scripts/setup.sh on npu installs the gateway's `.[npu]` extra only; the
dev tools only with NPUGW_DEV_TOOLS=1 (issue 33, ASCEND-REVIEW D3). Run on a
copy of the script in a temporary folder with a fake Python whose venv's
pip records what it is asked to install: nothing is installed anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# constraints/check_stack.py: the stack is there; -m venv [--system-site-packages] DIR: a fake venv
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  for dir; do :; done
  mkdir -p "$dir/bin"
  echo "include-system-site-packages = true" > "$dir/pyvenv.cfg"
  printf '#!/bin/sh\\necho "pip $*" >> "$PIP_LOG"\\n' > "$dir/bin/pip"
  printf '#!/bin/sh\\nexit 0\\n' > "$dir/bin/npu-gateway"
  chmod +x "$dir/bin/pip" "$dir/bin/npu-gateway"
fi
exit 0
"""


def run_setup(root: Path, **env: str) -> list[str]:
    log = root / "pip.log"
    log.unlink(missing_ok=True)
    r = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), "--force"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHON": str(root / "python"), "PIP_LOG": str(log), "NPUGW_DEVICE": "npu", **env},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return [ln for ln in log.read_text().splitlines() if " -e " in ln]


def test_npu_setup_installs_the_npu_extra_only_and_dev_tools_on_request(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "constraints", tmp_path / "constraints")
    (tmp_path / "python").write_text(FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    assert run_setup(tmp_path, NPUGW_DEV_TOOLS="") == ["pip install -q -c constraints/npu.txt -e .[npu]"]
    assert run_setup(tmp_path, NPUGW_DEV_TOOLS="1") == ["pip install -q -c constraints/npu.txt -e .[npu,dev]"]
