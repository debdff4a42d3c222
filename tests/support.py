"""Test helpers: free ports and real gateway processes on 127.0.0.1."""

from __future__ import annotations

import inspect
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = "SmolLM2-135M-Instruct"
EMBEDDING = "all-MiniLM-L6-v2"
ERROR_MARKS = ("Traceback", "ERROR", "Error:", "error:", "startup failed")
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range() -> tuple[int, int]:
    """The 12000 ports below the ephemeral range; under pytest-xdist each
    worker takes its own slice, so two workers never pick the same port
    between probing it and binding it (`_given` is per process)."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return low, high
    index = int(worker[2:])
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


def free_port() -> int:
    """A free port below the kernel's ephemeral range, never handed out
    twice in this process. A port bound to 0 comes from that range, where
    any outgoing connection made before the server binds it (an engine's,
    a health check's) can take it as its local port: a gateway then failed
    to start in CI with "address already in use" after its engines were up."""
    lo, hi = _port_range()
    for _ in range(200):
        port = random.randrange(lo, hi)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


class GatewayProcess:
    """`npu-gateway serve` as a real process; its log goes to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        full_env.pop("NPUGW_GC_FREEZE", None)  # set for in-process apps only (conftest)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float, path: str = "/ready") -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.report()}")
            try:
                return httpx.get(self.url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until_sync(ready, timeout, f"200 from {path}", interval=0.3)
        except AssertionError:
            raise TimeoutError(f"gateway not ready after {timeout}s:\n{self.report()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def report(self, context: int = 40) -> str:
        """The log's first error with the lines before it, then its tail:
        a failed start's cause is often far above the engines' shutdown
        lines and the interpreter's exit noise that end the log."""
        lines = [ln for ln in self.log().splitlines() if not ln.lstrip().startswith(("nanobind:", "- leaked"))]
        first = next((i for i, ln in enumerate(lines) if any(m in ln for m in ERROR_MARKS)), None)
        tail = "\n".join(lines[-30:])
        if first is None or first >= len(lines) - 30:
            return "\n".join(lines[-80:])
        head = "\n".join(lines[max(0, first - context) : first + context])
        return f"{head}\n[...]\n{tail}"

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # engine processes are in the same session: make sure none outlives us
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return int(self.proc.returncode)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    found = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    if not found:
        raise KeyError(f"no sample {name}{labels}")
    return total


def _said(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


async def wait_until(
    cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str | Callable[[], str] = "condition",
    interval: float = 0.005,
) -> None:
    """Poll `cond` (a function, or a coroutine function such as an HTTP
    probe) every `interval` seconds until it holds; fail after `timeout`
    seconds (a deadline for a hung test, not a timing assertion). `what`
    names the condition in the failure (a function: called then, to show
    the last state seen)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {_said(what)}")
        await asyncio.sleep(interval)


def wait_until_sync(
    cond: Callable[[], bool], timeout: float = 30.0, what: str | Callable[[], str] = "condition",
    interval: float = 0.02,
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {_said(what)}")
        time.sleep(interval)
