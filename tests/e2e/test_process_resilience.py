"""Real gateway processes on the simulated engine: SIGTERM drain, keys never
logged, 500 concurrent streams, schemathesis against /openapi.json."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
from support import GatewayProcess, free_port, metric_value, wait_until

pytestmark = pytest.mark.e2e
SIM = ["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim"]
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def start(tmp_path: Path, *args: str, name: str = "gw") -> GatewayProcess:
    gw = GatewayProcess([*SIM, *args], tmp_path / f"{name}.log")
    gw.wait_ready(timeout=60)
    return gw


async def read_stream(url: str, body: dict[str, object], started: asyncio.Event | None = None) -> list[str]:
    """The stream's `data:` payloads; `started` is set at the first one."""
    events: list[str] = []
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    return events


async def draining(url: str) -> bool:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url + "/ready")).status_code == 503


@pytest.mark.asyncio
async def test_sigterm_drains_in_flight_and_refuses_new(tmp_path: Path) -> None:
    gw = start(tmp_path, "--simulated-itl", "0.05", "--shutdown-timeout", "20")
    try:
        started = asyncio.Event()
        stream = asyncio.ensure_future(read_stream(gw.url, {**CHAT, "max_tokens": 40}, started))
        await wait_until(started.is_set, timeout=30, what="the stream's first chunk")
        gw.signal(signal.SIGTERM)
        await wait_until(lambda: draining(gw.url), timeout=10, what="/ready to say 503", interval=0.05)
        async with httpx.AsyncClient(timeout=10) as http:
            ready = await http.get(gw.url + "/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            new = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
            assert new.status_code == 503 and new.json()["error"]["code"] == "shutting_down"
            assert int(new.headers["retry-after"]) >= 1
        events = await stream
        assert events[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in map(orjson.loads, events[:-1]) if c.get("choices")
        )
        assert len(text.split()) == 40  # the in-flight stream finished whole
        assert gw.proc.wait(30) == 0
    finally:
        gw.stop()


@pytest.mark.asyncio
async def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path: Path) -> None:
    gw = start(tmp_path, "--simulated-itl", "0.05", "--shutdown-timeout", "1")
    try:
        started = asyncio.Event()
        stream = asyncio.ensure_future(read_stream(gw.url, {**CHAT, "max_tokens": 2000}, started))
        await wait_until(started.is_set, timeout=30, what="the stream's first chunk")
        t0 = time.monotonic()
        gw.signal(signal.SIGTERM)
        events = await stream
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["error"]["code"] == "shutting_down"
        assert gw.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        gw.stop()


def test_api_keys_never_logged(tmp_path: Path) -> None:
    secret, file_secret = "sk-flag-secret-123", "sk-file-secret-456"
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team-x\n    sha256: {hashlib.sha256(file_secret.encode()).hexdigest()}\n"
    )
    gw = start(tmp_path, "--api-key", secret, "--api-keys-file", str(keys), "--log-level", "debug")
    try:
        for key in (secret, file_secret, "sk-wrong-789"):
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": key})
        ok = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"api-key": file_secret})
        assert ok.status_code == 200
    finally:
        gw.stop()
    log = gw.log()
    assert "serving" in log  # the log was captured
    for s in (secret, file_secret, "sk-wrong-789"):
        assert s not in log


def test_a_taken_port_fails_before_the_app_starts(tmp_path: Path) -> None:
    """The port is bound before the app and its engines start: a port that
    another program holds fails at once (exit 1, a one-line reason), not
    after the engines have loaded (before: exit 3 once the app had started)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", free_port()))
        other.listen()
        taken = other.getsockname()[1]
        gw = GatewayProcess([*SIM, "--port", str(taken)], tmp_path / "taken.log")
        assert gw.proc.wait(60) == 1
        gw.stop()
    log = gw.log()
    assert f"cannot listen on 127.0.0.1:{taken}" in log
    assert "serving" not in log and "Application startup" not in log  # the app never started


@pytest.mark.asyncio
async def test_500_concurrent_streams_none_lost_none_duplicated(tmp_path: Path) -> None:
    gw = start(tmp_path, "--simulated-itl", "0.02", "--simulated-ttft", "0.05", "--max-num-seqs", "1000")
    try:
        n = 500
        sem_limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=sem_limits) as http:

            async def one(i: int) -> tuple[str, int, str]:
                body = {**CHAT, "max_tokens": 20, "stream": True, "user": f"u{i}"}
                async with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    ids, tokens, last = set(), 0, ""
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        last = line[6:]
                        if last != "[DONE]":
                            c = orjson.loads(last)
                            ids.add(c["id"])
                            tokens += sum(1 for ch in c["choices"] if ch["delta"].get("content"))
                    assert len(ids) == 1
                    return ids.pop(), tokens, last

            results = await asyncio.gather(*(one(i) for i in range(n)))
        assert all(last == "[DONE]" for _, _, last in results)
        assert all(tokens == 20 for _, tokens, _ in results)
        assert len({rid for rid, _, _ in results}) == n  # no stream lost or duplicated
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "npugw_engine_unfinished_requests", model_name="sim") == 0
        assert metric_value(metrics, "npugw_requests_running", model_name="sim") == 0
    finally:
        gw.stop()


def test_schemathesis_no_5xx_and_responses_match_schema(tmp_path: Path) -> None:
    """schemathesis (CLI: its pytest plugin does not load under pytest 9)
    against the served /openapi.json, with a key, bounded examples."""
    gw = start(tmp_path, "--api-key", "sk-schema", "--max-model-len", "512", "--max-request-body-bytes", "65536")
    try:
        cmd = [
            str(Path(sys.executable).parent / "schemathesis"), "run", gw.url + "/openapi.json",
            "-H", "Authorization: Bearer sk-schema",
            "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            "--max-examples", "30", "--seed", "1", "--request-timeout", "20",
            "--phases", "examples,coverage,fuzzing",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"})
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        tested = re.search(r"Tested:\s+(\d+)", out)
        assert tested is not None and int(tested.group(1)) >= 12, out[-3000:]  # every operation was exercised
        assert re.search(r"(\d+) generated", out) and int(re.search(r"(\d+) generated", out).group(1)) >= 300  # type: ignore[union-attr]
    finally:
        gw.stop()
    assert "Traceback" not in gw.log()
