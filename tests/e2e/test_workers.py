"""`npu-gateway serve --workers N` as real processes: a gateway-only front
(`--model none`) with 2 processes in front of a real node (a second gateway
on the simulated engine). Both processes answer on the one port, /metrics
(whichever process answers it) counts every request once, a SIGTERM drains
each process, and a killed process is replaced without losing the counts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import REPO, GatewayProcess, free_port, metric_value, wait_until_sync

pytestmark = pytest.mark.e2e

CHAT_ROUTE = "/v1/chat/completions"
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Tier:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[GatewayProcess] = []

    def node(self, *args: str) -> GatewayProcess:
        gw = GatewayProcess(
            ["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim", *args],
            self.tmp_path / "node.log",
        )
        self.started.append(gw)
        gw.wait_ready(timeout=90)
        return gw

    def front(self, node: GatewayProcess, workers: int = 2) -> GatewayProcess:
        gw = GatewayProcess(
            ["--model", "none", "--embedding-model", "none", "--upstream", f"sim={node.url}",
             "--workers", str(workers)],
            self.tmp_path / "front.log",
        )
        self.started.append(gw)
        gw.wait_ready(timeout=90)
        # Every process is up (each logs it once its app has started).
        wait_until_sync(lambda: len(serving(gw)) == workers, timeout=90, what=f"{workers} processes serving")
        return gw


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    t = Tier(tmp_path)
    yield t
    for gw in t.started:
        gw.stop()


def serving(gw: GatewayProcess) -> dict[int, int]:
    """process index -> pid of the latest start of each process."""
    return {int(i): int(pid) for i, pid in re.findall(r"gateway process (\d+) \(pid (\d+)\) serving", gw.log())}


def metrics(gw: GatewayProcess) -> str:
    return httpx.get(gw.url + "/metrics", timeout=10).text


def per_process(text: str) -> dict[str, float]:
    """Chat requests each process answered (npugw_process_http_requests_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "npugw_process_http_requests_total" and s.labels["route"] == CHAT_ROUTE:
                out[s.labels["process"]] = out.get(s.labels["process"], 0) + s.value
    return out


def chats(gw: GatewayProcess) -> float:
    try:
        return metric_value(metrics(gw), "npugw_http_requests_total", route=CHAT_ROUTE, status="200")
    except KeyError:
        return 0.0


def send(url: str, n: int, stream_every: int = 4) -> None:
    """`n` chat requests, each on a new connection (the kernel spreads
    connections, not requests, over the processes)."""
    for k in range(n):
        body = {**CHAT, "stream": k % stream_every == 0}
        with httpx.Client(timeout=30) as client:
            r = client.post(url + CHAT_ROUTE, json=body)
            assert r.status_code == 200, r.text
            if body["stream"]:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text


def test_two_processes_serve_one_port_and_metrics_count_each_request_once(tier: Tier) -> None:
    node = tier.node()
    front = tier.front(node)
    n = 40
    send(front.url, n)

    # Counters and histograms: summed over both processes, exactly once each,
    # whichever process answers the scrape.
    for _ in range(4):
        text = metrics(front)
        assert metric_value(text, "npugw_http_requests_total", route=CHAT_ROUTE, status="200") == n
        assert metric_value(text, "npugw_http_request_duration_seconds_count", route=CHAT_ROUTE) == n
        assert metric_value(text, "npugw_api_key_requests_total") == n
    # The node saw each request once (pass-through, no retries).
    assert chats(node) == n

    # Both processes answered (the per-process live counts are at most one
    # snapshot interval old), and they add up to the same total.
    wait_until_sync(lambda: sum(per_process(metrics(front)).values()) == n, timeout=10, what="live snapshots")
    counts = per_process(metrics(front))
    assert set(counts) == {"0", "1"}, counts
    assert all(c >= 1 for c in counts.values()), counts
    # Live state per process, with the `process` label.
    text = metrics(front)
    for p in ("0", "1"):
        assert metric_value(text, "npugw_queue_depth", process=p, model_name="sim") == 0
        assert metric_value(text, "npugw_upstream_up", process=p) == 1

    # SIGTERM: every process drains and exits, then the supervisor, with 0;
    # the temporary metrics folder goes with it.
    m = re.search(r"metrics in (\S+)", front.log())
    assert m, front.log()
    mp_dir = Path(m.group(1))
    assert mp_dir.is_dir()
    front.signal(signal.SIGTERM)
    assert front.proc.wait(30) == 0, front.log()[-3000:]
    assert not mp_dir.exists()
    for pid in serving(front).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("to", ["supervisor", "process-group"])
def test_sigterm_lets_each_process_finish_its_streams(to: str, tier: Tier) -> None:
    """`supervisor`: kill PID (docker, Kubernetes); `process-group`: every
    process gets SIGTERM directly too (a terminal's Ctrl-C, systemd's cgroup
    kill), and the supervisor's forwarded copy must not cut the drain short."""
    node = tier.node("--simulated-itl", "0.05")
    front = tier.front(node)
    body = {**CHAT, "max_tokens": 40, "stream": True}
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(timeout=30)) for _ in range(6)]
        lines = [stack.enter_context(c.stream("POST", front.url + CHAT_ROUTE, json=body)).iter_lines() for c in clients]
        firsts = [next(it) for it in lines]  # every stream has begun
        assert all(line.startswith("data: ") for line in firsts), firsts
        if to == "supervisor":
            front.signal(signal.SIGTERM)
        else:
            os.killpg(front.proc.pid, signal.SIGTERM)
        # New requests get 503 (or no connection) while the processes drain.
        wait_until_sync(lambda: _refused_or_503(front.url), timeout=10, what="drain to start")
        rests = [list(it) for it in lines]
    for rest in rests:
        data = [ln for ln in rest if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]", rest[-5:]
    assert front.proc.wait(30) == 0, front.log()[-3000:]


def _refused_or_503(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 503
    except httpx.HTTPError:
        return True


def test_a_killed_process_is_replaced_and_the_totals_stay(tier: Tier) -> None:
    node = tier.node()
    front = tier.front(node)
    send(front.url, 20)
    before = serving(front)
    os.kill(before[1], signal.SIGKILL)
    wait_until_sync(
        lambda: serving(front).get(1) not in (None, before[1]), timeout=90, what="process 1 restarted"
    )
    assert "gateway process 1 exited with -9: restarting it" in front.log()
    send(front.url, 20)
    # The dead process's counts are still in the totals.
    assert metric_value(metrics(front), "npugw_http_requests_total", route=CHAT_ROUTE, status="200") == 40
    assert front.proc.poll() is None


def test_workers_are_refused_with_a_local_engine(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--backend", "simulated", "--workers", "2",
         "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "--workers 2 needs gateway-only mode (--model none" in out.stderr
