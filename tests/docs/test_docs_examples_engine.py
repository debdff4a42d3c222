"""The documentation's examples run as pasted against a live gateway (the
session's real one: embedded models, real vLLM engine): every code block
marked `<!-- docs-test: run -->` in README.md and docs/, the Python ones with
the SDKs, the shell ones with curl. Only the address changes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from docs_blocks import Block, marked_blocks
from support import REPO, GatewayProcess

pytestmark = pytest.mark.engine

BLOCKS = marked_blocks()
DOCS_URL = "http://127.0.0.1:8000"
ERROR_BODY = re.compile(r'"error":\s*\{|"type":\s*"error"|"error_type"')  # OpenAI, Anthropic, TGI


def _run(block: Block, url: str) -> subprocess.CompletedProcess[str]:
    code = block.code.replace(DOCS_URL, url)
    if block.lang == "python":
        cmd = [sys.executable, "-c", code]
    else:  # an HTTP error status fails the block, as it would fail a reader
        cmd = ["bash", "-c", "set -euo pipefail\ncurl() { command curl --fail-with-body -sS \"$@\"; }\n" + code]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs_as_pasted(block: Block, real_gateway: GatewayProcess) -> None:
    assert DOCS_URL in block.code, "a runnable example talks to the documented address"
    r = _run(block, real_gateway.url)
    assert r.returncode == 0, f"{block.id} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{block.id} printed nothing"
    if block.lang == "bash":  # no error body or stream error event (a Responses object has "error": null)
        assert not ERROR_BODY.search(r.stdout), r.stdout[-2000:]
