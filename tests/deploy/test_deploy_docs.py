"""The deployment guides say what the files do."""

from __future__ import annotations

import re
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_ray_guide() -> None:
    text = (DEPLOY / "ray" / "README.md").read_text()
    assert "ray start --head" in text
    assert re.search(r"ray start --address=\S+:6379", text)
    for var in ("HCCL_IF_IP", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME",
                "ASCEND_RT_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"):
        assert var in text, var
    assert re.search(
        r"npu-gateway serve.*--distributed-executor-backend ray.*--tensor-parallel-size 8 --pipeline-parallel-size 2",
        text,
        flags=re.S,
    )
    assert "docs.vllm.ai/projects/ascend" in text  # the source it follows
    assert "with-cann-env" in text


def test_deploy_readme_links_resolve() -> None:
    for readme in (DEPLOY / "README.md", DEPLOY / "ray" / "README.md", DEPLOY / "nginx" / "README.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme.read_text()):
            if target.startswith("http"):
                continue
            assert (readme.parent / target).exists(), (readme, target)


def test_deploy_readme_says_what_was_verified() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "## What was verified where" in text
    assert "Not verified here" in text
    assert "terminationGracePeriodSeconds: 90" in text
