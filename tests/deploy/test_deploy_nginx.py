"""deploy/nginx: the production configs pass `nginx -t` with the real binary,
hold the settings the gateway relies on, and behave as documented in front
of small fake upstreams (real nginx, real sockets; the gateway itself is not
involved here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import deploy_services
import httpx
import pytest
import yaml

NGINX_DIR = Path(__file__).resolve().parents[2] / "deploy" / "nginx"
PROD = NGINX_DIR / "nginx.conf"
AFFINITY = NGINX_DIR / "nginx-session-affinity.conf"
HOST = NGINX_DIR / "nginx-host.conf"  # the plain-host variant of PROD
NGINX_README = NGINX_DIR / "README.md"
GATEWAY_DEFAULT_MAX_BODY = 4194304  # the gateway's --max-request-body-bytes default


def _directives(text: str, name: str) -> list[str]:
    """Arguments of every `name ...;` directive (comments stripped)."""
    code = re.sub(r"#[^\n]*", "", text)
    return [m.group(1).strip() for m in re.finditer(rf"(?<![\w$]){re.escape(name)}\s+([^;{{}}]*);", code)]


def _upstream_block(text: str) -> str:
    code = re.sub(r"#[^\n]*", "", text)
    m = re.search(r"upstream\s+npu_gateway\s*\{(.*?)\}", code, flags=re.S)
    assert m, "no upstream npu_gateway"
    return m.group(1)


def _render(conf: Path, listen_port: int, upstream_ports: list[int]) -> str:
    text = conf.read_text()
    text = deploy_services.rewrite_nginx_upstream(text, "npu_gateway", [f"127.0.0.1:{p}" for p in upstream_ports])
    return deploy_services.rewrite_nginx_listen(text, listen_port)


# ------------------------------------------------------------ static checks

@pytest.mark.parametrize("conf", [PROD, AFFINITY, HOST], ids=lambda p: p.name)
def test_config_passes_nginx_t(conf: Path, nginx_binary: str, tmp_path: Path) -> None:
    text = _render(conf, deploy_services.free_port(), [deploy_services.free_port(), deploy_services.free_port()])
    result = deploy_services.nginx_check_config(text, tmp_path, nginx=nginx_binary)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr
    assert "[emerg]" not in result.stderr


def test_nginx_t_rejects_a_broken_config(nginx_binary: str, tmp_path: Path) -> None:
    # The check can fail: a typo in a directive is caught.
    text = _render(PROD, deploy_services.free_port(), [deploy_services.free_port()])
    text = text.replace("proxy_buffering off;", "proxy_bufering off;")
    result = deploy_services.nginx_check_config(text, tmp_path, nginx=nginx_binary)
    assert result.returncode != 0
    assert "proxy_bufering" in result.stderr


@pytest.mark.parametrize("conf", [PROD, AFFINITY, HOST], ids=lambda p: p.name)
def test_config_has_the_production_settings(conf: Path) -> None:
    text = conf.read_text()
    up = _upstream_block(text)
    servers = re.findall(r"server\s+([^;]+);", up)
    assert len(servers) >= 2, "several replicas"
    for s in servers:
        assert re.search(r"\bmax_fails=\d+", s) and re.search(r"\bfail_timeout=\d+s", s), s
    assert re.search(r"\bkeepalive\s+64;", up)
    assert re.search(r"^\s*zone\s+npu_gateway\s+\d+k;", up, flags=re.M), "state shared by all workers"
    assert _directives(text, "proxy_http_version") == ["1.1", "1.1"]
    assert _directives(text, "proxy_set_header").count('Connection ""') == 2
    assert _directives(text, "proxy_buffering") == ["off"]
    assert _directives(text, "proxy_cache") == ["off"]
    assert _directives(text, "client_max_body_size") == ["4m"]
    assert 4 * 1024 * 1024 == GATEWAY_DEFAULT_MAX_BODY
    assert "X-Request-ID $npugw_request_id" in _directives(text, "proxy_set_header")
    assert re.search(r"map\s+\$http_x_request_id\s+\$npugw_request_id\s*\{[^}]*\"\"\s+\$request_id;", text)
    (next_upstream,) = _directives(text, "proxy_next_upstream")
    assert {"error", "timeout", "http_502", "http_503"} <= set(next_upstream.split())
    assert "http_429" not in next_upstream
    # The comment that explains the lack of active health checks.
    assert "NO active health checks" in text and "/ready" in text


def test_read_timeout_is_well_above_the_request_timeout(deploy_dir: Path) -> None:
    text = PROD.read_text()
    (read_timeout,) = _directives(text, "proxy_read_timeout")
    assert read_timeout == "3600s"
    cm = yaml.safe_load((deploy_dir / "k8s" / "base" / "configmap.yaml").read_text())
    assert int(cm["data"]["NPUGW_REQUEST_TIMEOUT"]) * 2 <= 3600
    assert int(cm["data"]["NPUGW_MAX_REQUEST_BODY_BYTES"]) == GATEWAY_DEFAULT_MAX_BODY


def test_balancing_methods() -> None:
    assert re.search(r"^\s*least_conn;", _upstream_block(PROD.read_text()), flags=re.M)
    aff = _upstream_block(AFFINITY.read_text())
    assert "least_conn" not in aff
    assert re.search(r"^\s*hash\s+\$npugw_affinity_key\s+consistent;", aff, flags=re.M)
    assert re.search(
        r"map\s+\$http_x_session_id\s+\$npugw_affinity_key\s*\{\s*default\s+\$http_x_session_id;\s*\"\"\s+\$request_id;",
        AFFINITY.read_text(),
    )


def test_the_two_configs_differ_only_in_balancing() -> None:
    def code(p: Path) -> list[str]:
        return [ln for ln in (re.sub(r"#[^\n]*", "", ln).rstrip() for ln in p.read_text().splitlines()) if ln.strip()]

    a, b = code(PROD), code(AFFINITY)
    only_a = [ln.strip() for ln in a if ln not in b]
    only_b = [ln.strip() for ln in b if ln not in a]
    assert only_a == ["least_conn;"]
    assert only_b == [
        "map $http_x_session_id $npugw_affinity_key {",
        "default $http_x_session_id;",
        "hash $npugw_affinity_key consistent;",
    ]


# ------------------------------------------- the install step on a plain host
#
# README: `sudo cp deploy/nginx/nginx-host.conf /etc/nginx/nginx.conf && sudo
# nginx -t` on RHEL/EulerOS and Debian/Ubuntu alike; the compose files need the
# documented `sed` (deploy/nginx/README.md). nginx.conf itself fails there:
# `user nginx;` (Debian/Ubuntu have www-data) and the compose host names.


def _code(text: str) -> list[str]:
    return [ln for ln in (re.sub(r"#[^\n]*", "", ln).rstrip() for ln in text.splitlines()) if ln.strip()]


def _documented_sed() -> str:
    """The `sed ...` of deploy/nginx/README.md that turns a compose config into a
    plain-host one (without its file argument and the `| sudo tee` part)."""
    m = re.search(
        r"^(sed .*?)deploy/nginx/nginx-session-affinity\.conf \| sudo tee /etc/nginx/nginx\.conf",
        NGINX_README.read_text(),
        flags=re.M | re.S,
    )
    assert m, "deploy/nginx/README.md: the plain-host sed command is missing"
    return m.group(1).replace("\\\n", " ").strip()


def _apply_documented_sed(conf: Path) -> str:
    cmd = f"{_documented_sed()} {shlex.quote(str(conf))}"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def _nginx_t_as_shipped(text: str, prefix: Path, nginx: str) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on `text` with its user and upstreams as they are: only the
    pid, log and temp paths move under `prefix` (the harness's usual
    rewrite); no `user root;` is added, so as root nginx resolves the
    build's default user, as `sudo nginx -t` does."""
    prefix.mkdir(parents=True, exist_ok=True)
    prepared = deploy_services.prepare_nginx_conf(text, prefix)
    prepared = prepared.removeprefix("user root;\n")
    assert _upstream_block(prepared) == _upstream_block(text)
    assert _directives(prepared, "user") == _directives(text, "user")
    conf = prefix / "nginx.conf"
    conf.write_text(prepared)
    return subprocess.run(
        [nginx, "-t", "-p", str(prefix), "-c", str(conf)], capture_output=True, text=True, timeout=30
    )


def test_host_variant_is_the_compose_config_with_the_documented_edits() -> None:
    host = HOST.read_text()
    assert _directives(host, "user") == [], "no user line: the package's build default (nginx / nobody)"
    servers = re.findall(r"server\s+(\S+)\s", _upstream_block(host))
    assert servers == ["127.0.0.1:8000", "127.0.0.1:8001"]
    # The documented sed turns nginx.conf into nginx-host.conf, line for line.
    assert _code(_apply_documented_sed(PROD)) == _code(host)
    assert "sudo cp deploy/nginx/nginx-host.conf /etc/nginx/nginx.conf && sudo nginx -t" in NGINX_README.read_text()


@pytest.mark.parametrize("conf", [HOST], ids=lambda p: p.name)
def test_host_variant_passes_nginx_t_as_shipped(conf: Path, nginx_binary: str, tmp_path: Path) -> None:
    result = _nginx_t_as_shipped(conf.read_text(), tmp_path, nginx_binary)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


@pytest.mark.parametrize("conf", [PROD, AFFINITY], ids=lambda p: p.name)
def test_compose_config_with_the_documented_sed_passes_nginx_t(conf: Path, nginx_binary: str, tmp_path: Path) -> None:
    text = _apply_documented_sed(conf)
    assert "gateway-1" not in "\n".join(_code(text)) and _directives(text, "user") == []
    result = _nginx_t_as_shipped(text, tmp_path, nginx_binary)
    assert result.returncode == 0, result.stderr


def _conf_path(nginx: str) -> str:
    v = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=30).stderr
    m = re.search(r"--conf-path=(\S+)", v)
    return m.group(1) if m else "/etc/nginx/nginx.conf"


# Inside a private mount namespace: tmpfs over the config folder, /var/log,
# /var/lib and /run, so the real step (`cp` to the packaged config path, a
# bare `nginx -t` as root) runs unchanged and leaves nothing on this host.
_INSTALL_STEP = """set -e
conf_dir=$(dirname "$2")
for d in "$conf_dir" /var/log /var/lib /run; do mount -t tmpfs tmpfs "$d"; done
mkdir -p /var/log/nginx /var/lib/nginx
cp "$1" "$2"
exec "$3" -t
"""


def _install_step(conf: Path, nginx: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0:
        pytest.skip("the install step is `sudo nginx -t`: it needs root (run pytest as root)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here (unshare --mount: {probe.stderr.strip()})")
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", _INSTALL_STEP, "step",
         str(conf), _conf_path(nginx), nginx],
        capture_output=True, text=True, timeout=60,
    )


def test_documented_install_step_on_this_host(nginx_binary: str, tmp_path: Path) -> None:
    """`sudo cp deploy/nginx/nginx-host.conf /etc/nginx/nginx.conf && sudo
    nginx -t`, the README's step, with this host's nginx package; the compose
    configs pass after the documented sed and fail as the issue reports
    without it."""
    ok = _install_step(HOST, nginx_binary)
    assert ok.returncode == 0, ok.stderr
    assert "test is successful" in ok.stderr
    for conf in (PROD, AFFINITY):
        fixed = tmp_path / f"host-{conf.name}"
        fixed.write_text(_apply_documented_sed(conf))
        ok = _install_step(fixed, nginx_binary)
        assert ok.returncode == 0, (conf.name, ok.stderr)
        broken = _install_step(conf, nginx_binary)
        assert broken.returncode != 0
        assert 'getpwnam("nginx") failed' in broken.stderr or 'host not found in upstream "gateway-1:8000"' in (
            broken.stderr
        ), broken.stderr


# -------------------------------------------------------- fake upstreams

@dataclass
class Upstream:
    name: str
    status: int = 200
    requests: list[dict[str, object]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])


def _handler(up: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _record(self, body_len: int) -> None:
            up.requests.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "request_id": self.headers.get("X-Request-ID"),
                    "session_id": self.headers.get("X-Session-ID"),
                    "connection": self.headers.get("Connection"),
                    "body_len": body_len,
                }
            )

        def _reply(self, status: int, payload: dict[str, object]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status in (429, 503):
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", "0"))
            remaining = n
            while remaining:
                chunk = self.rfile.read(min(remaining, 1 << 16))
                if not chunk:
                    break
                remaining -= len(chunk)
            self._record(n)
            self._reply(up.status, {"upstream": up.name, "request_id": self.headers.get("X-Request-ID"), "body_len": n})

        def do_GET(self) -> None:
            self._record(0)
            if not self.path.startswith("/stream"):
                self._reply(up.status, {"upstream": up.name})
                return
            # An SSE stream: three events 0.6 s apart, chunked.
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for k, event in enumerate([f"data: {up.name}-1\n\n", f"data: {up.name}-2\n\n", "data: [DONE]\n\n"]):
                if k:
                    time.sleep(0.6)
                raw = event.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


@pytest.fixture
def upstreams() -> Iterator[Callable[[str, int], Upstream]]:
    started: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def make(name: str, status: int = 200) -> Upstream:
        up = Upstream(name, status)
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(up))
        server.daemon_threads = True
        up.server = server
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        started.append((server, thread))
        return up

    yield make
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _start(
    nginx_factory: Callable[..., object], conf: Path, ports: list[int]
) -> str:
    listen = deploy_services.free_port()
    nginx_factory(_render(conf, listen, ports))
    return f"http://127.0.0.1:{listen}"


def _chat(client: httpx.Client, base: str, **headers: str) -> httpx.Response:
    return client.post(f"{base}/v1/chat/completions", json={"messages": []}, headers=headers)


# ------------------------------------------------------ behaviour checks


@pytest.mark.e2e
def test_request_id_is_passed_through_or_generated(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    base = _start(nginx_factory, PROD, [a.port])
    with httpx.Client(timeout=10) as client:
        r = _chat(client, base, **{"X-Request-ID": "client-id-123"})
        assert r.status_code == 200
        assert r.json()["request_id"] == "client-id-123"
        r = _chat(client, base)
        generated = r.json()["request_id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated), generated
    # Keep-alive towards the upstream: nginx sends no `Connection: close`.
    assert all(req["connection"] in (None, "") for req in a.requests)


@pytest.mark.e2e
def test_failover_from_a_503_replica_and_a_dead_one(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    draining = upstreams("draining", 503)
    healthy = upstreams("healthy", 200)
    dead_port = deploy_services.free_port()  # nothing listens there
    base = _start(nginx_factory, PROD, [draining.port, dead_port, healthy.port])
    with httpx.Client(timeout=10) as client:
        for _ in range(9):
            r = _chat(client, base)
            assert r.status_code == 200, r.text
            assert r.json()["upstream"] == "healthy"
    # POSTs were retried after the 503 (non_idempotent), and the 503 replica
    # was taken out after max_fails=3 failures.
    assert 1 <= len(draining.requests) <= 3
    assert len(healthy.requests) == 9


@pytest.mark.e2e
def test_429_reaches_the_client_without_retry(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    full = upstreams("full", 429)
    base = _start(nginx_factory, PROD, [full.port])
    with httpx.Client(timeout=10) as client:
        r = _chat(client, base)
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "1"
    assert len(full.requests) == 1


@pytest.mark.e2e
def test_streams_pass_through_unbuffered(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    base = _start(nginx_factory, PROD, [a.port])
    arrivals: list[tuple[float, str]] = []
    with httpx.Client(timeout=10) as client:
        t0 = time.monotonic()
        with client.stream("GET", f"{base}/stream") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line:
                    arrivals.append((time.monotonic() - t0, line))
    assert [line for _, line in arrivals] == ["data: a-1", "data: a-2", "data: [DONE]"]
    # The first event arrives long before the stream ends (1.2 s later).
    assert arrivals[0][0] < 0.5, arrivals
    assert arrivals[-1][0] - arrivals[0][0] >= 1.0, arrivals


@pytest.mark.e2e
def test_least_conn_avoids_the_replica_busy_with_a_stream(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    b = upstreams("b")
    base = _start(nginx_factory, PROD, [a.port, b.port])
    with httpx.Client(timeout=10) as streaming, httpx.Client(timeout=10) as client:
        with streaming.stream("GET", f"{base}/stream") as r:
            lines = r.iter_lines()
            first = next(lines)  # "data: a-1": the stream is open on replica a or b
            busy = first.split(": ")[1].split("-")[0]
            others = [_chat(client, base).json()["upstream"] for _ in range(4)]
            assert set(others) == {"b" if busy == "a" else "a"}, (busy, others)
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.e2e
def test_body_limit_matches_the_gateway(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    base = _start(nginx_factory, PROD, [a.port])
    with httpx.Client(timeout=30) as client:
        ok = client.post(f"{base}/v1/completions", content=b"x" * GATEWAY_DEFAULT_MAX_BODY)
        assert ok.status_code == 200
        assert ok.json()["body_len"] == GATEWAY_DEFAULT_MAX_BODY
        too_big = client.post(f"{base}/v1/completions", content=b"x" * (GATEWAY_DEFAULT_MAX_BODY + 1))
        assert too_big.status_code == 413
    assert len(a.requests) == 1


@pytest.mark.e2e
def test_metrics_stay_internal_but_answer_from_loopback(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    base = _start(nginx_factory, PROD, [a.port])
    with httpx.Client(timeout=10) as client:
        assert client.get(f"{base}/metrics").status_code == 200  # 127.0.0.1 is allowed
        assert client.get(f"{base}/nginx-health").text == "ok\n"


@pytest.mark.e2e
def test_session_affinity_keeps_a_session_on_one_replica(
    nginx_factory: Callable[..., object], upstreams: Callable[..., Upstream]
) -> None:
    a = upstreams("a")
    b = upstreams("b")
    base = _start(nginx_factory, AFFINITY, [a.port, b.port])
    with httpx.Client(timeout=10) as client:
        for sid in ("alice", "bob", "carol", "dave"):
            seen = {_chat(client, base, **{"X-Session-ID": sid}).json()["upstream"] for _ in range(5)}
            assert len(seen) == 1, (sid, seen)
        spread = {_chat(client, base, **{"X-Session-ID": f"s{k}"}).json()["upstream"] for k in range(30)}
        assert spread == {"a", "b"}
        # No session header: requests still spread over both replicas.
        anonymous = {_chat(client, base).json()["upstream"] for _ in range(30)}
        assert anonymous == {"a", "b"}
