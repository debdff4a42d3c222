"""deploy/prometheus/npu-exporter-rules.yml: the gateway's NPU memory under
the Ascend NPU Exporter's names (MB, label `id`), checked and unit tested by
promtool (issue 33)."""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "deploy" / "prometheus" / "npu-exporter-rules.yml"
RULES_TEST = HERE / "promtool_npu_exporter_test.yml"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_recording_rules(promtool_binary: str) -> None:
    r = _run([promtool_binary, "check", "rules", RULES.name], RULES.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_test_of_the_mapping(promtool_binary: str, tmp_path: Path) -> None:
    r = _run([promtool_binary, "test", "rules", RULES_TEST.name], HERE)
    assert r.returncode == 0, r.stdout + r.stderr
    # the same test against a rule that forgets the MB conversion fails
    broken = tmp_path / "rules.yml"
    broken.write_text(RULES.read_text().replace(" / 1048576", ""))
    test = tmp_path / "test.yml"
    test.write_text(RULES_TEST.read_text().replace("../../deploy/prometheus/npu-exporter-rules.yml", "rules.yml"))
    r = _run([promtool_binary, "test", "rules", test.name], tmp_path)
    assert r.returncode != 0 and "3.437E+03" in r.stdout + r.stderr  # what it expected
