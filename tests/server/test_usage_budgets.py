"""Budgets per key from the keys file, enforced from the ledger at
admission (SQLite; the PostgreSQL tests share one budget across replicas):
429 before the first byte, streams included, with the budget's name, reset
time and headers; raised at run time; intact after a restart; expiry."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from sim_app import running_app
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig
from server.auth import KeysFileError, load_keys_file, sha256_hex
from server.settings import Settings

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ADMIN = {"Authorization": "Bearer sk-admin"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def keys_file(tmp: Path, **alice: Any) -> Path:
    path = tmp / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"name": "admin", "sha256": sha256_hex("sk-admin"), "admin": True},
        {"name": "alice", "sha256": sha256_hex("sk-alice"), **alice},
        {"name": "bob", "sha256": sha256_hex("sk-bob")},
    ]}))
    return path


def settings(tmp: Path, **alice: Any) -> Settings:
    return Settings(api_keys_file=keys_file(tmp, **alice), data_dir=tmp, access_log_format="off",
                    usage_flush_interval=0.05)


async def chat(c: Any, headers: dict[str, str], **kw: Any) -> Any:
    return await c.post("/v1/chat/completions", json={**CHAT, **kw}, headers=headers)


@pytest.mark.asyncio
async def test_a_spent_request_budget_is_429_before_the_first_byte(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, requests_per_day=3)) as (c, _):
        for i in range(3):
            r = await chat(c, ALICE)
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests-per-day"] == "3"
            assert r.headers["x-ratelimit-remaining-requests-per-day"] == str(3 - i)
        for stream in (False, True):
            r = await chat(c, ALICE, stream=stream)
            assert r.status_code == 429 and r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert err["code"] == "budget_exceeded" and err["type"] == "rate_limit_error"
            assert "requests_per_day" in err["message"] and "alice" in err["message"]
            tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00Z")
            assert tomorrow in err["message"]
            assert r.headers["x-ratelimit-remaining-requests-per-day"] == "0"
            assert r.headers["x-ratelimit-reset-requests-per-day"].endswith("s")
            assert 0 < int(r.headers["retry-after"]) <= 86400
        assert (await chat(c, BOB)).status_code == 200  # another key's budget is its own
        report = (await c.get("/admin/budgets", headers=ADMIN)).json()["data"]
        assert [k["key"] for k in report] == ["alice"]
        (b,) = report[0]["budgets"]
        assert b["name"] == "requests_per_day" and b["limit"] == 3 and b["used"] == 3
        assert b["resets_at"] == tomorrow and report[0]["expires_at"] is None


@pytest.mark.asyncio
async def test_token_budget_counts_prompt_and_completion_and_can_be_raised_at_run_time(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, tokens_per_month=60)) as (c, app):
        used = 0
        while True:
            r = await chat(c, ALICE)
            if r.status_code == 429:
                break
            assert r.status_code == 200
            usage = r.json()["usage"]
            used += usage["prompt_tokens"] + usage["completion_tokens"]
            assert used < 60 + usage["total_tokens"]  # admitted only while under the budget
        assert used >= 60 and "tokens_per_month" in r.json()["error"]["message"]
        report = (await c.get("/admin/budgets", headers=ADMIN)).json()["data"][0]["budgets"]
        assert report == [{"name": "tokens_per_month", "limit": 60, "used": used, "resets_at": report[0]["resets_at"]}]
        # raised with no restart: the key is served again at once
        r = await c.put("/admin/budgets/alice", json={"tokens_per_month": used + 1000, "requests_per_day": 50},
                        headers=ADMIN)
        assert r.status_code == 200, r.text
        got = {b["name"]: b for b in r.json()["budgets"]}
        assert got["tokens_per_month"]["limit"] == used + 1000 and got["requests_per_day"]["limit"] == 50
        assert (await chat(c, ALICE)).status_code == 200
        # a budget set to null has no limit any more
        r = await c.put("/admin/budgets/alice", json={"tokens_per_month": None}, headers=ADMIN)
        assert [b["name"] for b in r.json()["budgets"]] == ["requests_per_day"]
        assert app.state.budgets.effective["alice"].limits["tokens_per_month"] is None


@pytest.mark.asyncio
async def test_budgets_and_run_time_changes_survive_a_restart(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, requests_per_month=4)) as (c, _):
        for _ in range(2):
            assert (await chat(c, ALICE)).status_code == 200
        r = await c.put("/admin/budgets/alice", json={"requests_per_month": 5}, headers=ADMIN)
        assert r.status_code == 200
    async with running_app(settings(tmp_path, requests_per_month=4)) as (c, _):
        report = (await c.get("/admin/budgets", headers=ADMIN)).json()["data"][0]["budgets"]
        assert [(b["name"], b["limit"], b["used"]) for b in report] == [("requests_per_month", 5, 2)]
        for _ in range(3):
            assert (await chat(c, ALICE)).status_code == 200
        assert (await chat(c, ALICE)).status_code == 429
    async with running_app(settings(tmp_path, requests_per_month=4)) as (c, app):
        assert (await chat(c, ALICE)).status_code == 429
        await wait_until(lambda: app.state.usage.ledger.counts["written"] == 1, what="the 429's row")
        r = (await c.get("/admin/usage", params={"group_by": "key", "key": "alice"}, headers=ADMIN)).json()
        assert r["data"][0]["requests"] == 7 and r["data"][0]["errors"] == 2  # the two 429s are recorded too


@pytest.mark.asyncio
async def test_concurrent_streams_cannot_pass_a_request_budget(tmp_path: Path) -> None:
    sim = SimulatedConfig(max_model_len=256, ttft=0.05, itl=0.01)
    async with running_app(settings(tmp_path, requests_per_day=5), sim=sim) as (c, _):
        results = await asyncio.gather(*(chat(c, ALICE, stream=True) for _ in range(12)))
        codes = sorted(r.status_code for r in results)
        assert codes == [200] * 5 + [429] * 7  # in-flight requests hold their place


@pytest.mark.asyncio
async def test_an_expired_key_is_refused_and_can_be_extended(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, expires_at="2020-01-01")) as (c, _):
        r = await chat(c, ALICE)
        assert r.status_code == 401 and r.json()["error"]["code"] == "key_expired"
        assert "2020-01-01T00:00:00Z" in r.json()["error"]["message"]
        assert (await c.get("/v1/models", headers=ALICE)).status_code == 401
        r = await c.put("/admin/budgets/alice", json={"expires_at": "2999-01-01T00:00:00Z"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["expires_at"] == "2999-01-01T00:00:00Z"
        assert (await chat(c, ALICE)).status_code == 200


def test_keys_file_budget_fields_are_checked(tmp_path: Path) -> None:
    ok = load_keys_file(keys_file(tmp_path, tokens_per_day=10, expires_at="2027-01-01T12:00:00+01:00"))
    alice = next(e for e in ok if e.name == "alice")
    assert alice.tokens_per_day == 10
    assert alice.expires_at == datetime(2027, 1, 1, 11, tzinfo=timezone.utc).timestamp()
    for bad in ({"tokens_per_day": 0}, {"requests_per_month": "5"}, {"expires_at": "someday"}):
        with pytest.raises(KeysFileError, match="alice"):
            load_keys_file(keys_file(tmp_path, **bad))
