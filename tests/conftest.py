"""Shared fixtures. The real vLLM engine starts once per test session (one
gateway process serving the embedded generator and embedding models)."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator

import pytest
from support import GatewayProcess

# The gateway's databases (the usage ledger is on by default, stored
# responses) go to a folder of this test run, not the user's cache: apps
# built with Settings() and gateway processes (they inherit the environment).
os.environ.setdefault("NPUGW_DATA_DIR", tempfile.mkdtemp(prefix="npugw-test-data-"))

# Limits chosen so one shared engine serves every engine test: 8 running per
# engine, 32 waiting; readiness probes off the hot path for exact counters.
REAL_GATEWAY_ARGS = [
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--max-queue-size", "32",
    "--max-queue-wait", "120",
    "--readiness-interval", "3600",
    "--sse-keep-alive-interval", "2",
    "--seed", "0",
    "--admin-api-key", "sk-admin",  # guards /start_profile and /stop_profile only
]


def _freeze_test_heap() -> None:
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _unfrozen_at_exit() -> Iterator[None]:
    """Frozen objects outlive the interpreter's last collection: extension
    types (triton's nanobind) then report leaks at exit."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _frozen_test_heap() -> None:
    """The test process holds ~800k objects once collected (fastapi,
    pydantic, aiohttp, openai, ...): a full collection walked them all,
    0.6-0.9 s, and one landing inside a timed window failed a latency
    assertion in CI. What each module starts with is frozen, so the
    collector walks only what the tests allocate."""
    _freeze_test_heap()


@pytest.fixture(autouse=True)
def _no_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Apps started in this process would freeze the heap they start with,
    as the gateway does once in production: a full collection of the test
    process at every app start. Gateway processes the tests start freeze as
    usual (support.py drops the variable); the freeze itself has its own
    test, which unfreezes first: after it, the test heap is frozen again."""
    monkeypatch.setenv("NPUGW_GC_FREEZE", "0")
    frozen = gc.get_freeze_count()
    yield
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()
        _freeze_test_heap()


@pytest.fixture(scope="session")
def real_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("real-gateway")
    gw = GatewayProcess([*REAL_GATEWAY_ARGS, "--profile-dir", str(tmp / "profiles")], tmp / "gateway.log")
    gw.profile_dir = tmp / "profiles"  # type: ignore[attr-defined]
    try:
        gw.wait_ready(timeout=420)
        yield gw
    finally:
        gw.stop()
