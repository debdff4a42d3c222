"""A gateway-only front in front of a real `vllm serve` (the embedded
SmolLM2 weights, started through bench/vllm_cli.py as the benchmarks do):
`--upstream URL` discovers its one model under its id, `--upstream
remote=URL` serves it as `remote` (vLLM's /v1/models lists one model and says
nothing of its kind). Both answer as the node does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from support import EMBEDDED, REPO, GatewayProcess, free_port, wait_until_sync

pytestmark = pytest.mark.engine
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN = {"Authorization": "Bearer adm"}


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from engine_adapter.model import prepare_embedded_model

    model_dir = prepare_embedded_model(progress=False)
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}
    log_path = tmp_path_factory.mktemp("vllm-serve") / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "vllm_cli.py"), "serve", str(model_dir), "--served-model-name",
             EMBEDDED, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "4",
             "--dtype", "bfloat16", "--enforce-eager", "--disable-uvicorn-access-log"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_sync(lambda: _up(url) or proc.poll() is not None, timeout=300, what="vllm serve to start")
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def front(vllm_serve: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(["--model", "none", "--upstream", vllm_serve, "--upstream", f"remote={vllm_serve}",
                         "--admin-api-key", "adm"], tmp_path_factory.mktemp("front") / "front.log")
    try:
        gw.wait_ready(60)
        yield gw
    finally:
        gw.stop()


def test_vllm_serve_behind_a_front_by_discovery_and_by_name(front: GatewayProcess, vllm_serve: str) -> None:
    listed = {m["id"]: m for m in httpx.get(front.url + "/v1/models").json()["data"]}
    assert sorted(listed) == sorted([EMBEDDED, "remote"]) and listed[EMBEDDED]["max_model_len"] == 1024
    with (
        openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as via,
        openai.OpenAI(base_url=vllm_serve + "/v1", api_key="x", max_retries=0, timeout=120) as direct,
    ):
        want = direct.chat.completions.create(model=EMBEDDED, messages=PARIS, temperature=0, max_tokens=16)  # type: ignore[arg-type]
        assert want.choices[0].message.content
        for name in (EMBEDDED, "remote"):
            got = via.chat.completions.create(model=name, messages=PARIS, temperature=0, max_tokens=16)  # type: ignore[arg-type]
            assert got.model == name and got.choices[0].message.content == want.choices[0].message.content
            parts = []
            for chunk in via.chat.completions.create(model=name, messages=PARIS, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                                     stream=True):
                assert chunk.model == name
                parts.extend(c.delta.content or "" for c in chunk.choices)
            assert "".join(parts) == want.choices[0].message.content
    routes = {u["upstream"]: u["urls"][0] for u in httpx.get(front.url + "/admin/routes", headers=ADMIN).json()
              ["upstreams"]}
    assert routes["remote"]["model"] == EMBEDDED and routes["remote"]["embedding_model"] is None
    assert routes[vllm_serve.removeprefix("http://")]["serves"] == [EMBEDDED]
    assert "serves model 'SmolLM2-135M-Instruct'" in front.log()
