"""The usage ledger and budgets on a real PostgreSQL (started by the tests
with initdb/pg_ctl on 127.0.0.1), behind real gateway processes on the
simulated engine: usage and budgets intact after a restart; PostgreSQL
stopped in the middle of a few hundred requests (none fails, and once it
is back the ledger holds one row per request); two replicas sharing one
database and one budget."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pg_server import PostgresServer
from support import GatewayProcess, metric_value, wait_until_sync

from server.auth import sha256_hex

pytestmark = pytest.mark.e2e

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ADMIN = {"Authorization": "Bearer sk-admin"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture
def database(postgres: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A fresh database for one test."""
    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "")[:40] + "_" + os.urandom(3).hex()
    return postgres.new_database(name)


def keys_file(tmp: Path, **alice: Any) -> Path:
    path = tmp / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"name": "admin", "sha256": sha256_hex("sk-admin"), "admin": True},
        {"name": "alice", "sha256": sha256_hex("sk-alice"), **alice},
        {"name": "bob", "sha256": sha256_hex("sk-bob")},
    ]}))
    return path


def gateway_args(tmp: Path, db: str, name: str, keys: Path, *extra: str) -> list[str]:
    return ["--api-keys-file", str(keys), "--usage-db", db, "--data-dir", str(tmp / name),
            "--usage-flush-interval", "0.05", "--access-log-format", "off", *extra]


def count_rows(pg: PostgresServer, db: str, where: str = "true") -> int:
    name = db.rsplit("/", 1)[1]
    out = pg.psql_db(name, f"SELECT count(*) FROM usage_records WHERE {where}")
    return int(out)


async def send(url: str, n: int, concurrency: int, headers: dict[str, str],
               on_done: Callable[[int], None] | None = None) -> list[int]:
    """`n` chat requests, `concurrency` at a time; their statuses."""
    statuses: list[int] = []
    queue = list(range(n))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                r = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                statuses.append(r.status_code)
                if on_done is not None:
                    on_done(len(statuses))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def budgets_of(gw: GatewayProcess, key: str) -> list[dict[str, Any]]:
    data = httpx.get(gw.url + "/admin/budgets", headers=ADMIN, timeout=30).json()["data"]
    return next(k["budgets"] for k in data if k["key"] == key)


def test_usage_and_budgets_are_intact_after_a_restart(
    tmp_path: Path, database: str, sim_gateways: Callable[..., list[GatewayProcess]], postgres: PostgresServer
) -> None:
    keys = keys_file(tmp_path, requests_per_day=10)
    (gw,) = sim_gateways(gateway_args(tmp_path, database, "a", keys))
    for _ in range(6):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=ALICE, timeout=30).status_code == 200
    r = httpx.put(gw.url + "/admin/budgets/alice", json={"requests_per_day": 8}, headers=ADMIN, timeout=30)
    assert r.status_code == 200
    assert gw.stop() == 0
    assert count_rows(postgres, database, "key = 'alice'") == 6

    (again,) = sim_gateways(gateway_args(tmp_path, database, "b", keys))  # another data dir: nothing local
    assert [(b["name"], b["limit"], b["used"]) for b in budgets_of(again, "alice")] == [("requests_per_day", 8, 6)]
    codes = [httpx.post(again.url + "/v1/chat/completions", json=CHAT, headers=ALICE, timeout=30).status_code
             for _ in range(3)]
    assert codes == [200, 200, 429]
    wait_until_sync(lambda: count_rows(postgres, database, "key = 'alice'") == 9, what="9 rows for alice")
    usage = httpx.get(again.url + "/admin/usage", params={"group_by": "key", "key": "alice"}, headers=ADMIN).json()
    assert usage["data"][0]["requests"] == 9 and usage["data"][0]["errors"] == 1


@pytest.mark.asyncio
async def test_postgres_stopped_mid_load_fails_no_request_and_loses_no_row(
    tmp_path: Path, database: str, sim_gateways: Callable[..., list[GatewayProcess]], postgres: PostgresServer
) -> None:
    total = 300
    (gw,) = sim_gateways(gateway_args(tmp_path, database, "a", keys_file(tmp_path), "--usage-write-timeout", "2"))
    stopped = asyncio.Event()
    done_at_stop = 0

    def on_done(n: int) -> None:
        nonlocal done_at_stop
        if n == 100 and not stopped.is_set():
            done_at_stop = n
            stopped.set()

    async def outage() -> None:
        await stopped.wait()
        await asyncio.to_thread(postgres.stop, "immediate")

    load = asyncio.ensure_future(send(gw.url, total, 8, BOB, on_done))
    await outage()
    statuses = await load
    assert statuses == [200] * total  # the database being down failed no request

    def accounted() -> bool:  # a record is sunk after its response is sent: wait until each is written or spooled
        m = httpx.get(gw.url + "/metrics", timeout=30).text
        done = sum(metric_value(m, "npugw_usage_records_total", outcome=o) for o in ("written", "spooled"))
        return done == total

    wait_until_sync(accounted, timeout=30, what=f"all {total} records written or spooled")
    metrics = httpx.get(gw.url + "/metrics", timeout=30).text
    spooled = metric_value(metrics, "npugw_usage_records_total", outcome="spooled")
    assert spooled > 0 and metric_value(metrics, "npugw_usage_spool_bytes") > 0
    assert metric_value(metrics, "npugw_usage_database_up") == 0
    written_before = metric_value(metrics, "npugw_usage_records_total", outcome="written")
    assert written_before < total

    await asyncio.to_thread(postgres.start)
    wait_until_sync(lambda: count_rows(postgres, database) == total, timeout=90, what=f"{total} rows after the outage")
    metrics = httpx.get(gw.url + "/metrics", timeout=30).text
    assert metric_value(metrics, "npugw_usage_records_total", outcome="replayed") == spooled
    print(f"outage: {total} requests, {written_before:.0f} written before PostgreSQL stopped, {spooled:.0f} spooled "
          "and replayed")
    assert metric_value(metrics, "npugw_usage_spool_bytes") == 0
    assert count_rows(postgres, database) == total  # and no more: each record once
    assert done_at_stop == 100


@pytest.mark.asyncio
async def test_two_replicas_share_one_budget(
    tmp_path: Path, database: str, sim_gateways: Callable[..., list[GatewayProcess]], postgres: PostgresServer
) -> None:
    limit, concurrency = 30, 4
    keys = keys_file(tmp_path, requests_per_day=limit)
    a, b = sim_gateways(
        gateway_args(tmp_path, database, "a", keys, "--simulated-ttft", "0.2"),
        gateway_args(tmp_path, database, "b", keys, "--simulated-ttft", "0.2"),
    )
    got_a, got_b = await asyncio.gather(
        send(a.url, 3 * limit, concurrency, ALICE), send(b.url, 3 * limit, concurrency, ALICE)
    )
    ok_a, ok_b = got_a.count(200), got_b.count(200)
    print(f"two replicas served {ok_a} + {ok_b} = {ok_a + ok_b} requests on a budget of {limit}")
    assert set(got_a) | set(got_b) == {200, 429}
    assert ok_a > 0 and ok_b > 0  # both replicas served the key
    # Together they spent the budget and went over it by no more than what
    # they had in flight.
    assert limit <= ok_a + ok_b <= limit + 2 * concurrency, (ok_a, ok_b)
    wait_until_sync(
        lambda: count_rows(postgres, database, "key = 'alice' AND status = 200") == ok_a + ok_b,
        what="the served requests in the ledger",
    )
    for gw in (a, b):
        wait_until_sync(lambda gw=gw: budgets_of(gw, "alice")[0]["used"] == ok_a + ok_b,
                        what="each replica to see the other's use")
    # raised on one replica, the other applies it at its next refresh
    r = httpx.put(a.url + "/admin/budgets/alice", json={"requests_per_day": ok_a + ok_b + 5}, headers=ADMIN)
    assert r.status_code == 200
    wait_until_sync(lambda: budgets_of(b, "alice")[0]["limit"] == ok_a + ok_b + 5, what="b to read the new budget")
    assert httpx.post(b.url + "/v1/chat/completions", json=CHAT, headers=ALICE, timeout=30).status_code == 200
