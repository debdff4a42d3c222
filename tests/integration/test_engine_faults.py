"""Faults with the real engine: an EngineCore process killed by its PID, and
32 concurrent streams on the shared engine."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
from support import EMBEDDED, GatewayProcess, metric_value, wait_until

pytestmark = pytest.mark.engine


def engine_cores(pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


async def both_engines_running(url: str) -> bool:
    """Each of the two engines runs a request (vLLM's scheduler gauge)."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url + "/metrics")).text
    return all(metric_value(text, "vllm:num_requests_running", model_name=EMBEDDED, engine=e) >= 1 for e in "01")


async def stream_events(url: str, max_tokens: int, started: asyncio.Event | None = None) -> list[str]:
    body = {
        "model": EMBEDDED, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
    }
    events = []
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    return events


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("faults") / "gateway.log"
    gw = GatewayProcess(
        ["--num-workers", "2", "--embedding-model", "none", "--max-model-len", "1024",
         "--readiness-interval", "2"],
        log,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        gw.wait_ready(timeout=480)
        yield gw
    finally:
        gw.stop()


@pytest.mark.asyncio
async def test_killed_engine_core_fails_its_requests_cleanly_and_restarts(two_workers: GatewayProcess) -> None:
    url = two_workers.url
    cores = engine_cores(two_workers.proc.pid)
    assert len(cores) == 2, [c.cmdline() for c in cores]
    # one long stream per worker (least-loaded dispatch), then kill one core
    started = [asyncio.Event(), asyncio.Event()]
    streams = [asyncio.ensure_future(stream_events(url, 200, s)) for s in started]
    await wait_until(lambda: all(s.is_set() for s in started), timeout=240, what="both streams' first chunk")
    victim = cores[0]
    os.kill(victim.pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*streams), timeout=240)
    ends = sorted(r[-2] != "[DONE]" and "error" in orjson.loads(r[-2]) for r in results)
    assert all(r[-1] == "[DONE]" for r in results)  # no stream left hanging
    assert ends == [False, True]  # exactly the dead worker's stream got an error event
    failed = next(r for r in results if "error" in orjson.loads(r[-2]))
    assert orjson.loads(failed[-2])["error"]["code"] == "engine_dead"

    async with httpx.AsyncClient(timeout=120) as http:
        # the other worker keeps serving while the dead one restarts
        body = {"model": EMBEDDED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        ok = await http.post(url + "/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text
        async def restarted() -> bool:
            text = (await http.get(url + "/metrics")).text
            return (metric_value(text, "npugw_workers_alive", model_name=EMBEDDED),
                    metric_value(text, "npugw_worker_restarts_total", model_name=EMBEDDED)) == (2, 1)

        await wait_until(restarted, timeout=240, what="2 alive workers after 1 restart", interval=1)
        assert len(engine_cores(two_workers.proc.pid)) == 2
        assert victim.pid not in [c.pid for c in engine_cores(two_workers.proc.pid)]
        rs = await asyncio.gather(*(http.post(url + "/v1/chat/completions", json=body) for _ in range(4)))
        assert [r.status_code for r in rs] == [200] * 4
        ready = (await http.get(url + "/ready")).json()
        assert ready["models"][EMBEDDED] == {"alive": 2, "ready": 2}


@pytest.mark.asyncio
async def test_plain_request_on_dying_engine_gets_503(two_workers: GatewayProcess, tmp_path: Path) -> None:
    url = two_workers.url
    body = {"model": EMBEDDED, "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as http:
        reqs = [asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body)) for _ in range(2)]
        await wait_until(lambda: both_engines_running(url), timeout=240, what="a request on each engine", interval=0.2)
        os.kill(engine_cores(two_workers.proc.pid)[1].pid, signal.SIGKILL)
        rs = await asyncio.wait_for(asyncio.gather(*reqs), timeout=240)
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 503]
    err = next(r for r in rs if r.status_code == 503).json()["error"]
    assert err["code"] == "engine_dead" and "Traceback" not in err["message"]


@pytest.mark.asyncio
async def test_32_concurrent_streams_on_the_real_engine(real_gateway: GatewayProcess) -> None:
    async def one(i: int) -> tuple[str, int, str]:
        body = {"model": EMBEDDED, "messages": [{"role": "user", "content": f"Say a word about {i}."}],
                "max_tokens": 12, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        ids, last, usage = set(), "", 0
        async with httpx.AsyncClient(timeout=300) as http:
            async with http.stream("POST", real_gateway.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    last = line[6:]
                    if last != "[DONE]":
                        c = orjson.loads(last)
                        ids.add(c["id"])
                        if c.get("usage"):
                            usage = c["usage"]["completion_tokens"]
        assert len(ids) == 1
        return ids.pop(), usage, last

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert all(last == "[DONE]" for _, _, last in results)
    assert all(n == 12 for _, n, _ in results)
    assert len({rid for rid, _, _ in results}) == 32
    text = httpx.get(real_gateway.url + "/metrics").text
    assert metric_value(text, "npugw_engine_unfinished_requests", model_name=EMBEDDED) == 0
    assert metric_value(text, "npugw_queue_depth", model_name=EMBEDDED) == 0
