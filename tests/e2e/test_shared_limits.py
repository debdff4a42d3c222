"""Limits shared by replicas through a real redis-server (`--state-url`):
gateway-only fronts (`--model none --upstream`) in front of a simulated
node, one of them with `--workers 2`, behind the real nginx with the
production config. A key with 20 requests/min gets 20 in all;
`max_concurrent: 2` holds across replicas; the leases of a SIGKILLed
replica lapse within the lease TTL; the store killed in the middle of a
run: `open` keeps serving, `closed` answers 503 + Retry-After; restarted,
the limits are shared again without restarting a gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deploy_services
import httpx
import pytest
import yaml
from redis_server import RedisMissing, RedisServer
from support import GatewayProcess, metric_value, wait_until_sync

from server.auth import sha256_hex

pytestmark = pytest.mark.e2e

NGINX_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "nginx.conf"
ROUTE = "/v1/chat/completions"
TTL = 2.0
KEYS = {
    "twenty": {"requests_per_minute": 20},
    "pair": {"max_concurrent": 2},
    "killed": {"max_concurrent": 2},
    "outage": {"requests_per_minute": 100000},
    "after": {"requests_per_minute": 5},
}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}"}


def chat(max_tokens: int = 2, stream: bool = False) -> dict[str, object]:
    return {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream}


@dataclass
class Tier:
    redis: RedisServer
    node: GatewayProcess
    a: GatewayProcess  # --workers 2
    b: GatewayProcess
    closed: GatewayProcess  # --state-fail closed, not behind nginx
    url: str  # nginx
    tmp: Path
    started: list[GatewayProcess]

    def front(self, name: str, *extra: str) -> GatewayProcess:
        gw = GatewayProcess(
            ["--model", "none", "--embedding-model", "none", "--upstream", f"sim={self.node.url}",
             "--api-keys-file", str(self.tmp / "keys.yaml"), "--state-url", self.redis.url,
             "--state-lease-ttl", str(TTL), "--access-log-format", "off", "--usage-db", "none",
             "--responses-db", "none", *extra],
            self.tmp / f"{name}.log",
        )
        self.started.append(gw)
        return gw


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    tmp = tmp_path_factory.mktemp("shared")
    (tmp / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"name": n, "sha256": sha256_hex(f"sk-{n}"), **lim} for n, lim in KEYS.items()
    ]}))
    try:
        redis = RedisServer()
    except RedisMissing as e:
        pytest.fail(str(e), pytrace=False)
    redis.start()
    started: list[GatewayProcess] = []
    nginx = None
    try:
        node = GatewayProcess(["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim",
                               "--simulated-itl", "0.05", "--access-log-format", "off", "--usage-db", "none"],
                              tmp / "node.log")
        started.append(node)
        node.wait_ready(timeout=90)
        t = Tier(redis, node, None, None, None, "", tmp, started)  # type: ignore[arg-type]
        t.a = t.front("a", "--workers", "2")
        t.b = t.front("b")
        t.closed = t.front("closed", "--state-fail", "closed")
        for gw in (t.a, t.b, t.closed):
            gw.wait_ready(timeout=90)
        wait_until_sync(lambda: up_values(t.a) == [1.0, 1.0], timeout=60, what="both processes of a on the store")
        port = deploy_services.free_port()
        conf = NGINX_CONF.read_text()
        conf = deploy_services.rewrite_nginx_upstream(conf, "npu_gateway", [t.a.url[7:], t.b.url[7:]])
        conf = deploy_services.rewrite_nginx_listen(conf, port)
        nginx = deploy_services.start_nginx(conf, tmp / "nginx", nginx=deploy_services.find_binary("nginx"))
        t.url = f"http://127.0.0.1:{port}"
        yield t
    finally:
        if nginx is not None:
            deploy_services.stop_process(nginx, signal.SIGQUIT)
        for gw in started:
            gw.stop()
        redis.destroy()


def up_values(gw: GatewayProcess) -> list[float]:
    """npugw_state_store_up of every process of `gw` (one sample per process)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "npugw_state_store_up"]


async def burst(url: str, key: str, n: int, body: dict[str, object]) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth(key)) as c:
        rs = await asyncio.gather(*(c.post(ROUTE, json=body) for _ in range(n)))
    return [r.status_code for r in rs]


def test_twenty_requests_per_minute_in_all_across_replicas_and_processes(tier: Tier) -> None:
    before = [served(gw) for gw in (tier.a, tier.b)]
    statuses = asyncio.run(burst(tier.url, "twenty", 30, chat()))
    assert sorted(statuses) == [200] * 20 + [429] * 10, statuses
    after = [served(gw) for gw in (tier.a, tier.b)]
    # nginx spread them: without the store each replica would have let 20 through
    assert all(x > y for x, y in zip(after, before, strict=True)), (before, after)
    r = httpx.post(tier.url + ROUTE, json=chat(), headers=auth("twenty"), timeout=30)
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


def served(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    try:
        return metric_value(text, "npugw_http_requests_total", route=ROUTE)
    except KeyError:
        return 0.0


async def _concurrency_run(url: str, clients: int, seconds: float) -> tuple[int, list[tuple[float, float]]]:
    """`clients` loops of 0.5 s streams for `seconds`; a 429 is retried after 20 ms.
    Returns the 429 count and each admitted stream's [first token, last token] interval."""
    spans: list[tuple[float, float]] = []
    refused = 0
    stop = time.monotonic() + seconds

    async def loop(c: httpx.AsyncClient) -> None:
        nonlocal refused
        while time.monotonic() < stop:
            async with c.stream("POST", ROUTE, json=chat(10, stream=True)) as r:
                if r.status_code == 429:
                    refused += 1
                    await r.aread()
                    await asyncio.sleep(0.02)
                    continue
                assert r.status_code == 200
                times = [time.monotonic() async for line in r.aiter_lines() if '"content":"' in line]
                assert times, "an admitted stream without tokens"
                spans.append((times[0], times[-1]))

    async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth("pair")) as c:
        await asyncio.gather(*(loop(c) for _ in range(clients)))
    return refused, spans


def max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def test_max_concurrent_two_is_never_exceeded_across_replicas(tier: Tier) -> None:
    statuses = asyncio.run(burst(tier.url, "pair", 8, chat(40, stream=True)))  # 2 s each
    assert sorted(statuses) == [200, 200] + [429] * 6, statuses
    refused, spans = asyncio.run(_concurrency_run(tier.url, 6, 5.0))
    assert refused > 0 and len(spans) >= 8, (refused, len(spans))
    assert max_overlap(spans) == 2, sorted(spans)


def test_leases_of_a_sigkilled_replica_lapse_within_the_ttl(tier: Tier) -> None:
    k = tier.front("killed")
    k.wait_ready(timeout=90)
    got: list[int] = []

    def hold() -> None:  # two 100 s streams on k
        try:
            with httpx.stream("POST", k.url + ROUTE, json=chat(2000, stream=True), headers=auth("killed"),
                              timeout=120) as r:
                got.append(r.status_code)
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until_sync(lambda: got == [200, 200], timeout=30, what="two streams admitted on the doomed replica")
    r = httpx.post(tier.b.url + ROUTE, json=chat(), headers=auth("killed"), timeout=30)
    assert r.status_code == 429, r.text
    os.killpg(k.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    k.proc.wait(10)

    def admitted() -> bool:
        return httpx.post(tier.b.url + ROUTE, json=chat(), headers=auth("killed"), timeout=30).status_code == 200

    wait_until_sync(admitted, timeout=15, what="the dead replica's leases to lapse")
    freed = time.monotonic() - killed_at
    assert freed <= TTL + 3, f"freed after {freed:.1f} s (TTL {TTL} s)"  # slack: a loaded box
    for t in threads:
        t.join(10)


def test_store_killed_mid_run_follows_state_fail_and_sharing_resumes(tier: Tier) -> None:
    results: list[int] = []
    done = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=tier.url, timeout=30, headers=auth("outage")) as c:
            while not done.is_set():
                results.append(c.post(ROUTE, json=chat()).status_code)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_until_sync(lambda: len(results) >= 10, timeout=30, what="traffic before the outage")
        tier.redis.stop()
        n = len(results)
        wait_until_sync(lambda: len(results) >= n + 30, timeout=60, what="traffic during the outage")
        # open (a, b): served on per-process limits; closed: 503 + Retry-After, never a 500
        r = httpx.post(tier.closed.url + ROUTE, json=chat(), headers=auth("outage"), timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "service_unavailable"
        assert 0.0 in up_values(tier.b)
        text = httpx.get(tier.b.url + "/metrics", timeout=10).text
        assert metric_value(text, "npugw_state_store_errors_total") >= 1
        tier.redis.start()  # empty, same port
        for gw in (tier.a, tier.b, tier.closed):
            wait_until_sync(lambda gw=gw: all(v == 1.0 for v in up_values(gw)), timeout=20,  # type: ignore[misc]
                            what="the store back")
        m = len(results)
        wait_until_sync(lambda: len(results) >= m + 10, timeout=30, what="traffic after the outage")
    finally:
        done.set()
        worker.join(30)
    assert set(results) == {200}, {s: results.count(s) for s in set(results)}
    r = httpx.post(tier.closed.url + ROUTE, json=chat(), headers=auth("outage"), timeout=30)
    assert r.status_code == 200
    statuses = asyncio.run(burst(tier.url, "after", 12, chat()))
    assert sorted(statuses) == [200] * 5 + [429] * 7, statuses  # one set of limits again
    warned = [gw.log().count("does not answer") for gw in (tier.a, tier.b)]
    assert all(1 <= w <= 2 for w in warned), warned  # once a minute per process, not once per request
