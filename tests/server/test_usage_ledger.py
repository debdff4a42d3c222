"""The usage ledger on SQLite, through the real app on simulated engines:
one row per request (served, refused, failed, cancelled), the reports and
their bad input, the spool while the database fails, and the CLI."""

from __future__ import annotations

import asyncio
import csv
import io
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sim_app import running_app
from support import REPO, wait_until

from engine_adapter.backends.simulated import SimulatedConfig
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
ADMIN = {"Authorization": "Bearer sk-admin"}
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}


def settings(tmp: Path, **kw: Any) -> Settings:
    kw.setdefault("usage_flush_interval", 0.05)
    return Settings(api_key=["sk-a", "sk-b"], admin_api_key="sk-admin", data_dir=tmp, access_log_format="off", **kw)


def rows(tmp: Path) -> list[dict[str, Any]]:
    con = sqlite3.connect(tmp / "usage.db")
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM usage_records ORDER BY ts")]
    finally:
        con.close()


@pytest.mark.asyncio
async def test_one_row_per_request_whatever_became_of_it(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path), sim=SimulatedConfig(max_model_len=256, ttft=0.01)) as (c, app):
        assert (await c.post("/v1/chat/completions", json=CHAT, headers={**A, "X-Request-ID": "r1"})).status_code == 200
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=B)
        assert r.status_code == 200 and "[DONE]" in r.text
        assert (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=A)).status_code == 400
        assert (await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})).status_code == 401
        assert (await c.post("/v1/embeddings", json={"model": "emb", "input": "abc"}, headers=A)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # not an API request: not usage
        ledger = app.state.usage.ledger
        await wait_until(lambda: ledger.counts["written"] == 5, what="5 rows written")
    got = rows(tmp_path)
    assert len(got) == 5
    plain, streamed, bad, unauth, emb = got
    assert plain["request_id"] == "r1" and plain["key"] == "key-1" and plain["model"] == "sim"
    assert plain["target"] == "sim" and plain["status"] == 200 and plain["finish_reason"] == "length"
    assert plain["completion_tokens"] == 3 and plain["prompt_tokens"] > 0 and plain["endpoint"] == "/v1/chat/completions"
    assert plain["duration"] >= plain["ttft"] >= 0.01 and plain["queue_wait"] >= 0 and plain["upstream"] is None
    assert streamed["key"] == "key-2" and streamed["completion_tokens"] == 3
    assert bad["status"] == 400 and bad["completion_tokens"] == 0
    assert unauth["status"] == 401 and unauth["key"] == ""
    assert emb["endpoint"] == "/v1/embeddings" and emb["model"] == "emb" and emb["prompt_tokens"] > 0
    assert len({r["id"] for r in got}) == 5


@pytest.mark.asyncio
async def test_reports_by_key_model_and_time_as_json_and_csv(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path)) as (c, app):
        for headers, n in ((A, 3), (B, 2)):
            for _ in range(n):
                assert (await c.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
        assert (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=B)).status_code == 400
        await wait_until(lambda: app.state.usage.ledger.counts["written"] == 6, what="6 rows")
        span = {"from": "2020-01-01", "to": "2100-01-01T00:00:00Z"}
        by_key = (await c.get("/admin/usage", params={**span, "group_by": "key"}, headers=ADMIN)).json()
        assert by_key["object"] == "list" and by_key["group_by"] == "key"
        assert by_key["from"] == "2020-01-01T00:00:00Z" and by_key["to"] == "2100-01-01T00:00:00Z"
        groups = {g["group"]: g for g in by_key["data"]}
        assert set(groups) == {"key-1", "key-2"}
        assert groups["key-1"]["requests"] == 3 and groups["key-1"]["completion_tokens"] == 9
        assert groups["key-1"]["errors"] == 0 and groups["key-2"]["errors"] == 1 and groups["key-2"]["requests"] == 3
        assert groups["key-1"]["prompt_tokens"] > 0 and groups["key-1"]["cached_tokens"] == 0
        one = (await c.get("/admin/usage", params={**span, "group_by": "model", "key": "key-2"}, headers=ADMIN)).json()
        # the refused request's body was never read: no model (null)
        assert {g["group"]: g["requests"] for g in one["data"]} == {"sim": 2, None: 1}
        for g, width in (("hour", 3600), ("day", 86400)):
            data = (await c.get("/admin/usage", params={**span, "group_by": g}, headers=ADMIN)).json()["data"]
            assert sum(d["requests"] for d in data) == 6
            assert all(d["group"].endswith("Z") for d in data)
            from datetime import datetime

            assert all(datetime.fromisoformat(d["group"]).timestamp() % width == 0 for d in data)
        month = (await c.get("/admin/usage", params={**span, "group_by": "month"}, headers=ADMIN)).json()["data"]
        assert sum(d["requests"] for d in month) == 6 and all(d["group"][8:] == "01T00:00:00Z" for d in month)
        r = await c.get("/admin/usage", params={**span, "group_by": "key", "format": "csv"}, headers=ADMIN)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(r.text)))
        assert {t["group"]: int(t["requests"]) for t in table} == {"key-1": 3, "key-2": 3}
        # an empty window, and a model no one asked for
        early = (await c.get("/admin/usage", params={"from": "2020-01-01", "to": "2020-02-01"}, headers=ADMIN)).json()
        assert early["data"] == []
        none = await c.get("/admin/usage", params={**span, "model": "other"}, headers=ADMIN)
        assert none.status_code == 200 and none.json()["data"] == []
        # a key reads its own usage only
        own = (await c.get("/v1/usage", params={**span, "group_by": "key"}, headers=A)).json()
        assert [(g["group"], g["requests"]) for g in own["data"]] == [("key-1", 3)]
        assert (await c.get("/v1/usage", params={"key": "key-2"}, headers=A)).status_code == 404
        assert (await c.get("/v1/usage")).status_code == 401
        assert (await c.get("/admin/usage", headers=A)).status_code == 403


@pytest.mark.asyncio
async def test_bad_filters_and_dates_are_400_and_unknown_keys_404(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path)) as (c, _):
        for params, param in (
            ({"group_by": "week"}, "group_by"),
            ({"from": "yesterday"}, "from"),
            ({"to": "2026-13-01"}, "to"),
            ({"from": "2026-12-02", "to": "2026-12-01"}, "from"),
            ({"format": "xml"}, "format"),
            ({"key": ""}, "key"),
        ):
            r = await c.get("/admin/usage", params=params, headers=ADMIN)
            assert r.status_code == 400, (params, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.get("/admin/usage", params={"key": "nobody"}, headers=ADMIN)
        assert r.status_code == 404 and "nobody" in r.json()["error"]["message"]
        r = await c.put("/admin/budgets/nobody", json={"tokens_per_day": 5}, headers=ADMIN)
        assert r.status_code == 404
        r = await c.put("/admin/budgets/key-1", json={"tokens_per_day": -5}, headers=ADMIN)
        assert r.status_code == 400
        r = await c.put("/admin/budgets/key-1", json={"expires_at": "soon"}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at"
        r = await c.put("/admin/budgets/key-1", json={}, headers=ADMIN)
        assert r.status_code == 400


@pytest.mark.asyncio
async def test_ledger_off_answers_404_and_409(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, usage_db="none")) as (c, _):
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=A)).status_code == 200
        r = await c.get("/admin/usage", headers=ADMIN)
        assert r.status_code == 404 and "--usage-db none" in r.json()["error"]["message"]
        assert (await c.get("/v1/usage", headers=A)).status_code == 404
        r = await c.put("/admin/budgets/key-1", json={"tokens_per_day": 5}, headers=ADMIN)
        assert r.status_code == 409 and "ledger" in r.json()["error"]["message"]
        assert (await c.get("/admin/budgets", headers=ADMIN)).json()["data"] == []
    assert not (tmp_path / "usage.db").exists()


@pytest.mark.asyncio
async def test_a_failing_database_spools_and_replays_with_one_row_per_request(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path)) as (c, app):
        ledger = app.state.usage.ledger
        real_write = ledger._write
        ledger.retry_interval = 0.05

        async def broken(rows: list[dict[str, Any]], ours: bool = True) -> None:
            raise OSError("database is down")

        ledger._write = broken
        results = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT, headers=A) for _ in range(30)))
        assert all(r.status_code == 200 for r in results)  # no request failed or waited for the database
        await wait_until(lambda: ledger.counts["spooled"] == 30, what="30 spooled records")
        assert ledger.spool.size() > 0 and not ledger.healthy
        metrics = (await c.get("/metrics")).text
        assert "npugw_usage_database_up 0.0" in metrics
        ledger._write = real_write
        await wait_until(lambda: ledger.counts["replayed"] == 30, what="the spool replayed")
        assert await ledger.count() == 30 and ledger.spool.size() == 0
        metrics = (await c.get("/metrics")).text
        assert 'npugw_usage_records_total{outcome="replayed"} 30.0' in metrics
        assert "npugw_usage_spool_bytes 0.0" in metrics


@pytest.mark.asyncio
async def test_records_in_the_buffer_at_shutdown_are_written(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, usage_flush_interval=3600.0)) as (c, app):
        for _ in range(7):
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=A)).status_code == 200
        await wait_until(lambda: len(app.state.usage.ledger._buffer) == 7, what="7 buffered")
        assert app.state.usage.ledger.counts["written"] == 0
    assert len(rows(tmp_path)) == 7


def record(i: int) -> dict[str, Any]:
    return {"time": "2026-12-01T10:55:44.123Z", "request_id": f"r{i}", "key": "team-a", "method": "POST",
            "endpoint": "/v1/chat/completions", "model": "m", "target": "m", "status": 200, "finish_reason": "stop",
            "prompt_tokens": i, "completion_tokens": 1, "cached_tokens": 0, "duration": 0.01}


@pytest.mark.asyncio
async def test_a_cycle_writes_what_it_found_in_multi_row_chunks(tmp_path: Path) -> None:
    """A write cycle takes the records buffered when it began (in chunks of
    up to SQLITE_CHUNK rows per statement, every value in its column); those
    that come in while it writes wait for the next cycle, so a busy gateway
    writes big batches instead of chasing its request rate one small batch
    after another."""
    from server.usage.budgets import BudgetBook
    from server.usage.ledger import SQLITE_CHUNK, Ledger

    led = Ledger(f"sqlite+aiosqlite:///{tmp_path / 'usage.db'}", tmp_path / "spool", BudgetBook([]),
                 flush_interval=3600, batch_size=1000)
    await led.start(30)
    try:
        first = SQLITE_CHUNK + 45  # one full chunk and then 32 + 8 + 4 + 1
        for i in range(first):
            led.sink(record(i))
        write = led._write
        sizes: list[int] = []

        async def write_and_receive(rows_: list[dict[str, Any]], *a: Any, **kw: Any) -> None:
            sizes.append(len(rows_))
            if len(sizes) == 1:
                for i in range(first, first + 7):  # requests that finish while the first batch is written
                    led.sink(record(i))
            await write(rows_, *a, **kw)

        led._write = write_and_receive  # type: ignore[method-assign]
        await led.flush()
        assert sizes == [first] and len(led._buffer) == 7 and led.counts["written"] == first
        led._write = write  # type: ignore[method-assign]
        await led.flush()
        assert led.counts["written"] == first + 7 and not led._buffer
    finally:
        await led.close()
    got = rows(tmp_path)
    assert sorted(r["prompt_tokens"] for r in got) == list(range(first + 7))
    assert len({r["id"] for r in got}) == first + 7
    r = next(r for r in got if r["request_id"] == "r5")
    assert (r["key"], r["endpoint"], r["status"], r["finish_reason"], r["duration"]) == (
        "team-a", "/v1/chat/completions", 200, "stop", 0.01)


@pytest.mark.asyncio
async def test_migrations_are_versioned_and_applied_once(tmp_path: Path) -> None:
    from server.usage.migrate import VERSION_TABLE, head

    for _ in range(2):  # the second start finds the schema current
        async with running_app(settings(tmp_path)) as (c, app):
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=A)).status_code == 200
            await wait_until(lambda: app.state.usage.ledger.counts["written"] == 1, what="1 row")
    con = sqlite3.connect(tmp_path / "usage.db")
    try:
        assert con.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(head(),)]
    finally:
        con.close()
    assert len(rows(tmp_path)) == 2


@pytest.mark.asyncio
async def test_the_cli_prints_the_same_table(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path)) as (c, app):
        for headers in (A, A, B):
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
        await wait_until(lambda: app.state.usage.ledger.counts["written"] == 3, what="3 rows")
        api = (await c.get("/admin/usage", params={"group_by": "key", "format": "csv"}, headers=ADMIN)).text

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "server.cli", "usage", "--data-dir", str(tmp_path), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=120)

    out = cli("--group-by", "key", "--format", "csv")
    assert out.returncode == 0, out.stderr
    assert out.stdout == api
    table = cli("--group-by", "key")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["group", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors"]
    assert [ln.split()[:2] for ln in lines[2:]] == [["key-1", "2"], ["key-2", "1"]]
    bad = cli("--from", "not-a-date")
    assert bad.returncode == 2 and "from" in bad.stderr
