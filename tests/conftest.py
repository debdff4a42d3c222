"""Shared fixtures. The real vLLM engine starts once per test session (one
gateway process serving the embedded generator and embedding models)."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import httpx
import pytest
from support import EMBEDDING, GatewayProcess

# The gateway's databases (the usage ledger is on by default, stored
# responses) go to a folder of this test run, not the user's cache: apps
# built with Settings() and gateway processes (they inherit the environment).
# pytest-xdist's workers inherit the controller's folder: each takes its own
# subfolder, so no two processes share one SQLite file.
os.environ.setdefault("NPUGW_DATA_DIR", tempfile.mkdtemp(prefix="npugw-test-data-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["NPUGW_DATA_DIR"] = os.path.join(os.environ["NPUGW_DATA_DIR"], os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["NPUGW_DATA_DIR"], exist_ok=True)

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
        gw.embedding_first_use = first_embedding_use(gw)  # type: ignore[attr-defined]
        yield gw
    finally:
        gw.stop()


def first_embedding_use(gw: GatewayProcess) -> dict[str, Any]:
    """The embedding engine starts on its first request by default on CPU
    (--embedding-start auto): what the gateway showed before, during and
    after that start (tests/integration/test_api_surface_engine.py checks
    it). The session's tests then find the engine running, as the soak's
    idle task and fd counts need."""
    def state() -> dict[str, Any]:
        ready = httpx.get(gw.url + "/ready", timeout=10)
        models = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        return {
            "ready_status": ready.status_code,
            "ready_model": ready.json()["models"].get(EMBEDDING),
            "max_model_len": next((m["max_model_len"] for m in models if m["id"] == EMBEDDING), None),
            "ready_gauge": f'npugw_workers_ready{{model_name="{EMBEDDING}"}}' in metrics,
        }

    before = state()
    health_during: list[int] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        body = {"model": EMBEDDING, "input": "first use"}
        first = pool.submit(httpx.post, gw.url + "/v1/embeddings", json=body, timeout=300)
        while True:
            try:
                r = first.result(timeout=0.05)
                break
            except FutureTimeout:  # meanwhile the gateway answers: the engine starts off its event loop
                health_during.append(httpx.get(gw.url + "/health", timeout=5).status_code)
    took = time.monotonic() - t0
    dim = len(r.json()["data"][0]["embedding"]) if r.status_code == 200 else None
    return {"before": before, "after": state(), "status": r.status_code, "body": r.text[:300], "dim": dim,
            "seconds": took, "health_during": health_during}
