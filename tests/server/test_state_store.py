"""The shared limits' logic (server/state_store.py, server/limits.py) against
a real redis-server started by this module: several `Limits` with their own
clients stand for several gateway processes. Sliding window for requests and
tokens, leases that lapse without renewal, settlement to the real token
count, values another program wrote, the store killed and back, and a
malformed --state-url."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis_server import RedisMissing, RedisServer
from support import wait_until

from engine_adapter.errors import RateLimited, ServiceUnavailable
from server.auth import KeyEntry, Principal
from server.limits import Admission, Limits
from server.metrics import GatewayMetrics
from server.settings import Settings
from server.state_store import StateStore
from server.state_url import StateUrlError, check_state_url


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    try:
        srv = RedisServer()
    except RedisMissing as e:
        pytest.fail(str(e), pytrace=False)
    srv.start()
    try:
        yield srv
    finally:
        srv.destroy()


@pytest_asyncio.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    if redis_server.proc is None:
        redis_server.start()
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


class Replica:
    """One gateway process's limits over its own client to the store."""

    def __init__(self, url: str, fail: str = "open", ttl: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        self.store = StateStore(url, timeout=0.25, lease_ttl=ttl, registry=self.registry)
        self.limits = Limits(GatewayMetrics(self.registry), self.store, fail)

    async def admit(self, entry: KeyEntry, tokens: int = 10) -> Admission:
        return await self.limits.admit(Principal(entry.name, entry), "m", tokens)

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v


@pytest_asyncio.fixture
async def replicas(redis_server: RedisServer, raw: aioredis.Redis) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []

    async def make(n: int, **kw: object) -> list[Replica]:
        for _ in range(n):
            r = Replica(redis_server.url, **kw)  # type: ignore[arg-type]
            await r.store.start()
            made.append(r)
        return made[-n:]

    yield make  # type: ignore[misc]
    for r in made:
        await r.store.close()


def key(name: str = "alice", **limits: int) -> KeyEntry:
    return KeyEntry(name=name, sha256="x", **limits)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_requests_per_minute_hold_across_processes(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b, c = await replicas(3)
    e = key(requests_per_minute=20)
    accepted = refused = 0
    retry: list[float] = []
    for i in range(30):
        try:
            adm = await (a, b, c)[i % 3].admit(e)
        except RateLimited as err:
            refused += 1
            assert err.retry_after is not None
            retry.append(err.retry_after)
        else:
            accepted += 1
            adm.finish(5, 5)
    assert (accepted, refused) == (20, 10)
    assert all(0 < r <= 60 for r in retry), retry
    # The headers count what every process did.
    e2 = key("bob", requests_per_minute=5)
    await a.admit(e2)
    adm = await b.admit(e2)
    assert adm.headers()["x-ratelimit-remaining-requests"] == "3"
    assert adm.headers()["x-ratelimit-limit-requests"] == "5"


@pytest.mark.asyncio
async def test_tokens_per_minute_reserve_then_settle_to_the_real_count(replicas, raw) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas(2)
    e = key(tokens_per_minute=100)
    first = await a.admit(e, tokens=60)
    with pytest.raises(RateLimited, match="100 tokens per minute"):
        await b.admit(e, tokens=60)  # 60 reserved + 60 > 100
    first.finish(10, 5)  # it used 15, not 60
    await wait_until(lambda: not a.store._tasks, what="the settlement")
    adm = await b.admit(e, tokens=60)
    assert adm.headers()["x-ratelimit-remaining-tokens"] == str(100 - 15 - 60)
    with pytest.raises(RateLimited, match="needs 500"):
        await a.admit(e, tokens=500)


@pytest.mark.asyncio
async def test_max_concurrent_is_shared_and_freed_at_the_end(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas(2)
    e = key(max_concurrent=2)
    h1 = await a.admit(e)
    h2 = await b.admit(e)
    with pytest.raises(RateLimited, match="2 concurrent"):
        await a.admit(e)
    h1.finish(1)
    await wait_until(lambda: not a.store._tasks, what="the release")
    h3 = await b.admit(e)
    with pytest.raises(RateLimited):
        await a.admit(e)
    h2.finish(1)
    h3.finish(1)


@pytest.mark.asyncio
async def test_leases_of_a_dead_process_lapse_within_the_ttl_and_live_ones_are_renewed(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas(2, ttl=0.6)
    e = key(max_concurrent=2)
    await a.admit(e)  # held by a "process" that then dies: no renewal, no release
    a.store.leases.clear()
    live = await b.admit(e)  # b keeps renewing this one
    t0 = time.monotonic()
    with pytest.raises(RateLimited):
        await b.admit(e)

    async def freed() -> bool:
        try:
            (await b.admit(e)).finish(0)
        except RateLimited:
            return False
        return True

    while not await freed():
        assert time.monotonic() - t0 < 3, "the dead lease did not lapse"
        await asyncio.sleep(0.05)
    assert time.monotonic() - t0 >= 0.4  # not before its TTL
    await asyncio.sleep(1.5)  # > 2 TTLs: b's live lease is still held (renewed)
    await wait_until(lambda: not b.store._tasks, what="the release")
    h = await b.admit(e)
    with pytest.raises(RateLimited, match="2 concurrent"):
        await b.admit(e)
    h.finish(0)
    live.finish(0)


@pytest.mark.asyncio
async def test_values_another_program_wrote_are_treated_as_absent(replicas, raw, caplog) -> None:  # type: ignore[no-untyped-def]
    (a,) = await replicas(1)
    e = key("carol", requests_per_minute=3, tokens_per_minute=1000, max_concurrent=5)
    await raw.set("npugw:{carol}:w", "not a zset")
    await raw.hset("npugw:{carol}:t", mapping={"sum": "lots"})
    await raw.zadd("npugw:{carol}:l", {"x": 1})
    with caplog.at_level(logging.WARNING, logger="server.state_store"):
        adm = await a.admit(e, tokens=10)
    assert "did not parse" in caplog.text
    assert adm.headers()["x-ratelimit-remaining-requests"] == "2"
    assert adm.headers()["x-ratelimit-remaining-tokens"] == "990"
    assert a.store.available()


@pytest.mark.asyncio
async def test_store_down_open_falls_back_then_shares_again(replicas, redis_server, caplog) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas(2)
    e = key("dave", requests_per_minute=4)
    await a.admit(e)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="server.state_store"):
        # per process now: each lets 4 through
        for r in (a, b):
            for _ in range(4):
                await r.admit(e)
            with pytest.raises(RateLimited):
                await r.admit(e)
    assert caplog.text.count("does not answer") == 2  # one warning per process, not one per request
    assert a.value("npugw_state_store_up") == 0.0
    assert a.value("npugw_state_store_errors_total", op="admit") >= 1
    redis_server.start()
    await wait_until(lambda: a.store.available() and b.store.available(), timeout=5, what="the store back")
    assert a.value("npugw_state_store_up") == 1.0
    shared = 0
    for i in range(8):
        try:
            await (a, b)[i % 2].admit(e)
            shared += 1
        except RateLimited:
            pass
    assert shared == 4  # one set of limits again (the restarted store is empty)


@pytest.mark.asyncio
async def test_store_down_closed_refuses_with_503(replicas, redis_server) -> None:  # type: ignore[no-untyped-def]
    (a,) = await replicas(1, fail="closed")
    e = key("erin", requests_per_minute=100)
    await a.admit(e)
    redis_server.stop()
    for _ in range(2):
        with pytest.raises(ServiceUnavailable) as err:
            await a.admit(e)
        assert err.value.retry_after == 1.0
    # keys without limits do not need the store
    (await a.limits.admit(Principal("free", key("free")), "m", 1)).finish(0)
    redis_server.start()
    await wait_until(a.store.available, timeout=5, what="the store back")
    await a.admit(e)


@pytest.mark.asyncio
async def test_unreachable_at_start_follows_state_fail() -> None:
    from support import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    closed = Replica(url, fail="closed")
    opened = Replica(url, fail="open")
    for r in (closed, opened):
        await r.store.start()
    try:
        e = key(requests_per_minute=1)
        with pytest.raises(ServiceUnavailable):
            await closed.admit(e)
        await opened.admit(e)
        with pytest.raises(RateLimited):
            await opened.admit(e)
    finally:
        for r in (closed, opened):
            await r.store.close()


@pytest.mark.parametrize("url,why", [
    ("http://localhost:6379", "scheme"),
    ("localhost:6379", "scheme"),
    ("redis://", "no host"),
    ("redis://host:notaport/0", "Port"),
    ("redis://host:6379/db", "number"),
    ("unix://", "socket path"),
])
def test_malformed_state_url_is_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(StateUrlError, match=why):
        check_state_url(url)
    with pytest.raises(ValueError, match=why):
        Settings(state_url=url)


def test_good_state_urls() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@cache.example:6380/2", "unix:///run/valkey.sock",
                "redis://valkey"):
        assert check_state_url(url) == url
    assert Settings(state_url="none").state_url is None


@pytest.mark.asyncio
async def test_budget_totals_are_shared_by_replicas_with_their_own_ledgers(replicas, raw, caplog) -> None:  # type: ignore[no-untyped-def]
    from server.usage.budgets import BudgetBook
    from server.usage.periods import day_of, month_days

    e = key("frank", requests_per_day=3)
    a, b = await replicas(2)
    books = [BudgetBook([e]), BudgetBook([e])]
    for r, book in zip((a, b), books, strict=True):
        r.store.attach_budgets(book)
    now = time.time()
    books[0].recorded("frank", now, 1, 10)
    books[0].recorded("frank", now, 1, 10)
    books[1].recorded("frank", now, 1, 5)
    books[1].admit(e)  # b alone has seen 1 of 3
    books[1].release("frank")
    for r in (a, b, a, b):
        await r.store._exchange_budgets()
    assert books[1].used("frank", now)["requests_per_day"] == 3
    assert books[1].used("frank", now)["tokens_per_day"] == 25
    with pytest.raises(RateLimited, match="requests_per_day is 3 and 3 are used"):
        books[1].admit(e)
    # the ledger's count wins where it is larger (a store restarted empty)
    await raw.flushdb()
    await b.store._exchange_budgets()
    assert books[1].used("frank", now)["requests_per_day"] == 1  # b's own pending record
    # a total another program overwrote: ignored and logged, never an error
    first, _ = month_days(now)
    await raw.hset(f"npugw:{{frank}}:b:{first}", mapping={f"{day_of(now)}:r": "many"})
    with caplog.at_level(logging.WARNING, logger="server.state_store"):
        await b.store._exchange_budgets()
    assert "did not parse" in caplog.text
    await raw.set(f"npugw:{{frank}}:b:{first}", "a string")
    with caplog.at_level(logging.WARNING, logger="server.state_store"):
        await b.store._exchange_budgets()
    assert "treated as absent" in caplog.text and b.store.available()
