"""The access log through the real ASGI app on simulated engines: one line
per request with what happened, the client's request id, the trusted
proxies' X-Forwarded-For, and never a prompt or an output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from sim_app import running_app
from support import REPO, wait_until

from engine_adapter.backends.simulated import SimulatedConfig
from server.middleware import AccessLog, client_address, trace_id_of
from server.settings import Settings
from server.settings_parse import parse_proxies

SECRET = "the secret prompt words"
CHAT = {"model": "sim", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3}


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(s) for s in path.read_text().splitlines() if s]


@pytest.mark.asyncio
async def test_json_lines_for_stream_non_stream_embeddings_and_refusals(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    settings = Settings(access_log_format="json", access_log_file=log, api_key=["sk-live-123"])
    auth = {"Authorization": "Bearer sk-live-123"}
    async with running_app(settings, sim=SimulatedConfig(max_model_len=256, ttft=0.01)) as (client, _):
        r = await client.post("/v1/chat/completions", json=CHAT, headers={**auth, "X-Request-ID": "rid-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth)
        assert r.status_code == 200 and "[DONE]" in r.text
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": SECRET}, headers=auth)
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=auth)
        assert r.status_code == 400
        await wait_until(lambda: len(lines(log)) == 5)
    text = log.read_text()
    assert SECRET not in text and "The quick" not in text  # neither prompt nor output
    assert "sk-live-123" not in text  # the key's name, never the key
    plain, streamed, emb, unauth, bad = lines(log)
    assert plain["request_id"] == "rid-1" and plain["key"] == "key-1"
    assert plain["endpoint"] == "/v1/chat/completions" and plain["method"] == "POST"
    assert plain["model"] == "sim" and plain["target"] == "sim" and plain["status"] == 200
    assert plain["prompt_tokens"] > 0 and plain["completion_tokens"] == 3
    assert plain["queue_wait"] >= 0 and 0.01 <= plain["ttft"] <= plain["duration"]
    assert plain["client"] == "127.0.0.1" and plain["time"].endswith("Z")
    assert streamed["status"] == 200 and streamed["completion_tokens"] == 3 and streamed["ttft"] >= 0.01
    assert streamed["request_id"] != plain["request_id"]
    assert emb["endpoint"] == "/v1/embeddings" and emb["model"] == "emb" and emb["prompt_tokens"] > 0
    assert unauth["status"] == 401 and unauth["key"] is None and unauth["ttft"] is None
    assert bad["status"] == 400 and bad["completion_tokens"] is None


@pytest.mark.asyncio
async def test_text_format_and_client_trace_id(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with running_app(Settings(access_log_format="text", access_log_file=log)) as (client, _):
        r = await client.post("/v1/completions", json={"model": "sim", "prompt": "a b", "max_tokens": 2},
                              headers={"traceparent": tp})
        assert r.status_code == 200
        await wait_until(lambda: log.exists() and log.read_text().count("\n") == 1)
    line = log.read_text().strip()
    fields = dict(item.split("=", 1) for item in line.split(" "))
    assert fields["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert fields["endpoint"] == "/v1/completions" and fields["status"] == "200" and fields["key"] == "-"
    assert fields["completion_tokens"] == "2"


@pytest.mark.asyncio
async def test_off_writes_nothing(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    async with running_app(Settings(access_log_format="off", access_log_file=log)) as (client, _):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
    assert not log.exists()


def test_forwarded_for_only_from_trusted_proxies() -> None:
    proxies = parse_proxies(["10.0.0.0/8", "::1"])
    xff = {b"x-forwarded-for": b"6.6.6.6, 203.0.113.7, 10.1.2.3"}
    # from a trusted proxy: the rightmost address no trusted proxy owns
    assert client_address({"client": ("10.0.0.5", 1)}, xff, proxies) == "203.0.113.7"
    assert client_address({"client": ("::1", 1)}, {b"x-forwarded-for": b"198.51.100.1"}, proxies) == "198.51.100.1"
    # from anyone else, or with no proxies configured: the peer
    assert client_address({"client": ("192.0.2.1", 1)}, xff, proxies) == "192.0.2.1"
    assert client_address({"client": ("10.0.0.5", 1)}, xff, ()) == "10.0.0.5"
    assert client_address({"client": ("10.0.0.5", 1)}, {}, proxies) == "10.0.0.5"
    assert client_address({"client": None}, xff, proxies) == ""
    with pytest.raises(ValueError):
        Settings(trusted_proxies=["not-an-address"])
    assert Settings(trusted_proxies="10.0.0.1, 10.0.0.0/8").trusted_proxies == ["10.0.0.1", "10.0.0.0/8"]


def test_text_values_stay_one_field() -> None:
    log = AccessLog("text", None, ())
    line = log.line({"request_id": 'a b"\nc', "key": None, "status": 200})
    assert "\n" not in line and line.startswith('request_id="a b\\"\\nc" key=- status=200')
    assert trace_id_of({b"traceparent": b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01"}) is None
    assert trace_id_of({b"traceparent": b"garbage"}) is None


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = ("import sys; from server.app import create_app; from server.settings import Settings; "
            "create_app(Settings()); assert not [m for m in sys.modules if m.startswith('opentelemetry')]; "
            "assert 'server.tracing' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
