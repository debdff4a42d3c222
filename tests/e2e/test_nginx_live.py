"""The production nginx config (deploy/nginx/nginx.conf) in front of real
gateway processes.

nginx is the real binary running the real config; the harness rewrites only
the listen port, the upstream server addresses, the pid/log/temp paths and,
in the keep-alive tests, `proxy_read_timeout`. The gateways are real
`npu-gateway serve` processes on the simulated engine (`--backend
simulated`): what is under test is the HTTP path client -> nginx -> gateway,
not the model behind it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import deploy_services
import httpx
import orjson
import pytest
from support import GatewayProcess, metric_value, wait_until_sync

pytestmark = pytest.mark.e2e

PROD = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "nginx.conf"
HOST = PROD.with_name("nginx-host.conf")  # the plain-host variant (no user line, 127.0.0.1 replicas)
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CHAT_ROUTE = "/v1/chat/completions"

StartGateways = Callable[..., list[GatewayProcess]]
StartNginx = Callable[..., object]


def render(upstream_ports: list[int], listen_port: int, read_timeout: str | None = None, conf: Path = PROD) -> str:
    """deploy/nginx/nginx.conf (or `conf`) with only ports (and optionally the read timeout) changed."""
    text = conf.read_text()
    text = deploy_services.rewrite_nginx_upstream(text, "npu_gateway", [f"127.0.0.1:{p}" for p in upstream_ports])
    text = deploy_services.rewrite_nginx_listen(text, listen_port)
    if read_timeout is not None:
        text, n = re.subn(r"(?m)^(\s*)proxy_read_timeout\s+\S+;", rf"\g<1>proxy_read_timeout {read_timeout};", text)
        assert n == 1, "deploy/nginx/nginx.conf should set proxy_read_timeout once"
    return text


def front(
    start_nginx: StartNginx, gateways: list[GatewayProcess], name: str = "nginx", conf: Path = PROD, **kw: str
) -> str:
    """Start nginx in front of `gateways`; return its base URL."""
    port = deploy_services.free_port()
    start_nginx(render([gw.port for gw in gateways], port, conf=conf, **kw), name=name)
    return f"http://127.0.0.1:{port}"


def chat_count(gw: GatewayProcess) -> float:
    """Chat requests this replica answered with 200 (its own /metrics)."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    try:
        return metric_value(text, "npugw_http_requests_total", route=CHAT_ROUTE, status="200")
    except KeyError:  # no chat request yet
        return 0.0


def access_log(tmp_path: Path, name: str = "nginx") -> list[str]:
    return (tmp_path / name / "logs" / "access.log").read_text().splitlines()


def wait_logged(tmp_path: Path, count: int, name: str = "nginx", timeout: float = 5.0) -> list[str]:
    """The access log once it has `count` lines (nginx writes a line just
    after the response went out, so it may lag the client by a moment)."""
    wait_until_sync(lambda: len(access_log(tmp_path, name)) >= count, timeout, f"{count} {name} log lines", 0.05)
    return access_log(tmp_path, name)


# ------------------------------------------------------------- streaming

def test_stream_arrives_through_nginx_incrementally(
    sim_gateways: StartGateways, nginx_server: StartNginx
) -> None:
    """40 tokens 50 ms apart: the first chunk reaches the client long before
    the last, i.e. nginx passes SSE through unbuffered."""
    gateways = sim_gateways(["--simulated-itl", "0.05"], ["--simulated-itl", "0.05"])
    url = front(nginx_server, gateways)
    arrivals: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", url + CHAT_ROUTE, json={**CHAT, "max_tokens": 40, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - t0, line[6:]))
    assert arrivals and arrivals[-1][1] == "[DONE]"
    chunks = [orjson.loads(d) for _, d in arrivals[:-1]]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 40
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first < 1.0, f"first chunk after {first:.2f} s: nginx buffered the stream"
    assert last > 1.5, f"whole stream in {last:.2f} s: tokens were not paced"
    # Spread over time, not released in one burst at the end.
    half = sum(1 for t, _ in arrivals if t < first + (last - first) / 2)
    assert 10 <= half <= len(arrivals) - 10, [round(t, 2) for t, _ in arrivals]


# --------------------------------------------------- balancing, request id

@pytest.mark.parametrize("conf", [PROD, HOST], ids=lambda p: p.name)
def test_requests_spread_over_both_replicas(conf: Path, sim_gateways: StartGateways, nginx_server: StartNginx) -> None:
    gateways = sim_gateways([], [])
    url = front(nginx_server, gateways, conf=conf)
    before = [chat_count(gw) for gw in gateways]
    n = 12
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            r = client.post(url + CHAT_ROUTE, json=CHAT)
            assert r.status_code == 200, r.text
    deltas = [chat_count(gw) - b for gw, b in zip(gateways, before, strict=True)]
    assert sum(deltas) == n, deltas
    assert all(d >= 1 for d in deltas), f"least_conn sent everything to one replica: {deltas}"


def test_client_request_id_comes_back_unchanged(
    sim_gateways: StartGateways, nginx_server: StartNginx, tmp_path: Path
) -> None:
    gateways = sim_gateways([], [])
    url = front(nginx_server, gateways)
    rid = f"e2e-{uuid.uuid4().hex}"
    with httpx.Client(timeout=30) as client:
        r = client.post(url + CHAT_ROUTE, json=CHAT, headers={"X-Request-ID": rid})
        assert r.status_code == 200
        assert r.headers["x-request-id"] == rid
        stream_rid = rid + "-stream"
        with client.stream(
            "POST", url + CHAT_ROUTE, json={**CHAT, "stream": True}, headers={"X-Request-ID": stream_rid}
        ) as s:
            assert s.status_code == 200
            assert s.headers["x-request-id"] == stream_rid
            assert list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
        # Without one, nginx makes one ($request_id) and the gateway echoes it.
        r = client.post(url + CHAT_ROUTE, json=CHAT)
        assert r.status_code == 200
        made = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made), made
    log = "\n".join(wait_logged(tmp_path, 3))
    for expected in (rid, stream_rid, made):
        assert f"rid={expected} " in log


# ---------------------------------------------------------------- failover

@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_one_replica_fails_no_request(
    how: str, sim_gateways: StartGateways, nginx_server: StartNginx, tmp_path: Path
) -> None:
    gateways = sim_gateways([], [])
    url = front(nginx_server, gateways)
    victim, survivor = gateways
    with httpx.Client(timeout=30) as client:
        for _ in range(4):
            assert client.post(url + CHAT_ROUTE, json=CHAT).status_code == 200
        assert chat_count(victim) >= 1  # the victim was in rotation
        logged_before = len(wait_logged(tmp_path, 4))

        if how == "SIGTERM":
            victim.signal(signal.SIGTERM)
        else:
            os.killpg(victim.proc.pid, signal.SIGKILL)
        statuses = [client.post(url + CHAT_ROUTE, json=CHAT).status_code for _ in range(20)]
        assert statuses == [200] * 20

        code = victim.proc.wait(30)
        assert code == (0 if how == "SIGTERM" else -signal.SIGKILL)
        statuses = [client.post(url + CHAT_ROUTE, json=CHAT).status_code for _ in range(10)]
        assert statuses == [200] * 10
    assert survivor.proc.poll() is None

    # nginx did try the stopped replica and moved the request on (so the test
    # exercised failover, not just a balancer that happened to avoid it).
    after = wait_logged(tmp_path, logged_before + 30)[logged_before:]
    assert len(after) == 30, "\n".join(after)
    victim_addr = f"127.0.0.1:{victim.port}"
    retried = [ln for ln in after if victim_addr in ln and f"127.0.0.1:{survivor.port}" in ln]
    assert retried, "\n".join(after)
    assert all(" 200 " in ln for ln in after), "\n".join(after)


# ------------------------------------------------------------- keep-alive

async def _read_stream(url: str, body: dict[str, object]) -> tuple[list[tuple[float, str]], BaseException | None]:
    """Every line received (with its arrival time), and the error that ended
    the stream if it did not end cleanly."""
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=30)) as http:
            async with http.stream("POST", url + CHAT_ROUTE, json={**body, "stream": True}) as r:
                lines.append((time.monotonic() - t0, f"HTTP {r.status_code}"))
                async for line in r.aiter_lines():
                    lines.append((time.monotonic() - t0, line))
    except httpx.HTTPError as exc:
        lines.append((time.monotonic() - t0, f"ERROR {exc!r}"))
        return lines, exc
    return lines, None


@pytest.mark.asyncio
async def test_keep_alive_comments_hold_an_idle_stream_open_through_nginx(
    sim_gateways: StartGateways, nginx_server: StartNginx, tmp_path: Path
) -> None:
    """An idle stream survives nginx's read timeout thanks to the gateway's
    `: keep-alive` comments, and is cut without them.

    The issue asks for a stream idle for 60+ s to survive. The mechanism is
    nginx's `proxy_read_timeout` (the longest silence nginx tolerates between
    two reads from the gateway) against the gateway's
    `--sse-keep-alive-interval`. To keep the test short the timeout is
    rewritten to 3 s and the silence is 8 s (simulated time between the first
    and the second token; a stream's status line waits for its first token,
    so the keep-alives cover the silences after it): the same mechanism,
    scaled down. Production ratio: 3600 s timeout / 15 s keep-alive; here
    3 s / 1 s.

    The control: a gateway whose keep-alive interval (30 s) exceeds the
    timeout gets its stream cut by nginx after its first token, so the
    keep-alives (not anything else) are what held the first stream open.
    """
    ka, no_ka = sim_gateways(
        ["--sse-keep-alive-interval", "1", "--simulated-itl", "8", "--readiness-interval", "60"],
        ["--sse-keep-alive-interval", "30", "--simulated-itl", "8", "--readiness-interval", "60"],
        ready_path="/health",
    )
    url_ka = front(nginx_server, [ka], name="nginx-ka", read_timeout="3s")
    url_no_ka = front(nginx_server, [no_ka], name="nginx-no-ka", read_timeout="3s")
    body: dict[str, object] = {**CHAT, "max_tokens": 2}

    (lines, error), (cut_lines, _cut_error) = await asyncio.gather(
        _read_stream(url_ka, body), _read_stream(url_no_ka, body)
    )

    # With keep-alives every 1 s: the stream completes.
    assert error is None, lines
    assert lines[0][1] == "HTTP 200", lines
    data = [(t, ln[6:]) for t, ln in lines if ln.startswith("data: ")]
    assert data and data[-1][1] == "[DONE]", lines
    chunks = [orjson.loads(d) for _, d in data[:-1]]
    content = [(t, c) for (t, _), c in zip(data, chunks, strict=False)
               if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 2
    first, second = content[0][0], content[1][0]
    assert second - first > 6.0, f"the stream was not idle: {second - first:.1f} s between the tokens"
    keep_alives = [t for t, ln in lines if ln == ": keep-alive" and first < t < second]
    assert len(keep_alives) >= 5, lines
    # Nothing but keep-alives for > 3 s (nginx's timeout), and no silence of
    # 3 s or more between two things received.
    times = [t for t, ln in lines if ln]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 3.0, lines

    # Keep-alive interval above the nginx timeout: nginx cuts the stream
    # after its first token, 3 s into the silence.
    assert not any(ln == "data: [DONE]" for _, ln in cut_lines), cut_lines
    cut_content = [ln for _, ln in cut_lines if ln.startswith("data: ") and '"delta":{"content":"' in ln]
    assert len(cut_content) <= 1, cut_lines
    assert cut_lines[-1][0] < 7.5, f"cut after {cut_lines[-1][0]:.1f} s, not at nginx's 3 s"
    errors = (tmp_path / "nginx-no-ka" / "logs" / "error.log").read_text()
    assert "upstream timed out" in errors, errors[-2000:]
    assert "upstream timed out" not in (tmp_path / "nginx-ka" / "logs" / "error.log").read_text()
