"""The console's server side through the real ASGI app on simulated engines:
login (admin key only) and logout, the session cookie's attributes, the
cookie opening the admin reads but not the admin writes, the JSON the page
reads (workers, queue, devices, routes, history, recent requests, usage
with the ledger off), and neither the admin key nor an API key in any
answer. The page itself is driven in a real browser in
tests/e2e/test_console.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from sim_app import running_app
from support import wait_until

from engine_adapter.backends.simulated import SimulatedConfig
from server.console.history import History, Recent, percentile, wanted
from server.console.sessions import COOKIE, Sessions
from server.settings import Settings

ADMIN = "sk-admin-console-test-7f3a"
USER = "sk-user-console-test-91bc"
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "a prompt that must stay private"}], "max_tokens": 6}


def settings(tmp: Path, **kw: Any) -> Settings:
    return Settings(api_key=[USER], admin_api_key=ADMIN, access_log_format="off", data_dir=tmp, **kw)


async def login(client: httpx.AsyncClient, key: str) -> httpx.Response:
    return await client.post(
        "/console/login", content=f"key={key}", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )


def no_keys(text: str) -> None:
    assert ADMIN not in text and USER not in text


# ------------------------------------------------------------------ units

def test_percentile_nearest_rank() -> None:
    values = sorted(float(i) for i in range(1, 101))
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.9) == 3.0


def test_history_buckets_percentiles_tokens_and_bounds() -> None:
    h = History(bucket_s=10, span_s=60, max_samples=8)
    t0 = 1_000_000.0
    for i in range(20):  # bucket 0: 20 requests of 11 tokens, TTFT 0.01..0.20
        h.add({"status": 200, "ttft": (i + 1) / 100, "duration": (i + 1) / 100 + 1.0, "completion_tokens": 11,
               "prompt_tokens": 5}, now=t0 + 1)
    h.add({"status": 500, "completion_tokens": 0}, now=t0 + 12)  # bucket 1: an error, no latency
    s = h.series(now=t0 + 15)
    assert len(s["t"]) == 6 and s["t"][-1] == t0 + 10
    i0 = s["t"].index(t0)
    assert s["requests"][i0] == 20 and s["errors"][i0 + 1] == 1
    assert s["tokens_per_second"][i0] == 22.0  # 220 tokens over a closed 10 s bucket
    # at most 8 samples were kept, all from the offered ones
    p50 = s["ttft"]["p50"][i0]
    assert p50 is not None and 0.01 <= p50 <= 0.2
    assert s["itl"]["p50"][i0] == pytest.approx(0.1)  # 1 s over the 10 tokens after the first
    assert s["ttft"]["p50"][i0 + 1] is None
    assert s["totals"] == {"requests": 21, "errors": 1, "prompt_tokens": 100, "completion_tokens": 220}
    assert s["recent"]["requests"] == 20
    # an hour later (here: a minute) the buckets are gone
    later = h.series(now=t0 + 200)
    assert later["totals"]["requests"] == 0 and all(v is None for v in later["ttft"]["p99"])
    assert len(h._buckets) <= h.n_buckets


def test_recent_keeps_the_last_and_only_known_fields() -> None:
    r = Recent(size=3)
    for i in range(5):
        r.add({"request_id": str(i), "endpoint": "/v1/chat/completions", "prompt": "never", "status": 200})
    assert [x["request_id"] for x in r.items()] == ["4", "3", "2"]
    assert all("prompt" not in x for x in r.items()) and r.seen == 5
    assert not wanted({"endpoint": "/console/api/overview"}) and wanted({"endpoint": "/v1/completions"})


def test_sessions_ttl_logout_and_bound(tmp_path: Path) -> None:
    from server.auth import KeyStore

    now = [0.0]
    keys = KeyStore.from_settings(settings(tmp_path))
    s = Sessions(ttl=10, max_sessions=2, clock=lambda: now[0])
    assert s.login(keys, USER) is None  # a client key is not an admin key
    assert s.login(keys, "wrong") is None and s.login(keys, "") is None
    a = s.login(keys, ADMIN)
    assert a is not None and ADMIN not in a
    p = s.principal(a)
    assert p is not None and p.admin
    now[0] = 9.0
    assert s.principal(a) is not None  # use renews it
    now[0] = 18.0
    assert s.principal(a) is not None
    now[0] = 29.0
    assert s.principal(a) is None  # 11 s idle
    b, c, d = (s.login(keys, ADMIN) for _ in range(3))
    assert len(s) == 2 and s.principal(b) is None and s.principal(d) is not None
    s.logout(d)
    assert s.principal(d) is None and s.principal(c) is not None


# ------------------------------------------------------------ through the app

@pytest.mark.asyncio
async def test_login_cookie_logout_and_refusals(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path)) as (client, _):
        r = await client.get("/console")
        assert r.status_code == 200 and 'name="key"' in r.text and "console.js" not in r.text
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert (await client.get("/console/api/overview")).status_code == 401

        for wrong in ("nope", USER):  # a client key does not open the console
            r = await login(client, wrong)
            assert r.status_code == 401 and 'id="login-error"' in r.text and COOKIE not in r.headers.get("set-cookie", "")
            no_keys(r.text)
        assert (await client.get("/console/api/overview")).status_code == 401

        r = await login(client, ADMIN)
        assert r.status_code == 303 and r.headers["location"] == "/console"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
        no_keys(cookie)
        page = await client.get("/console")
        assert "console.js" in page.text
        no_keys(page.text)
        assert (await client.get("/console/api/overview")).status_code == 200
        # the cookie opens the admin reads, not the writes
        assert (await client.get("/admin/routes")).status_code == 200
        r = await client.post("/admin/routes", json={"aliases": {"x": {"sim": 1}}})
        assert r.status_code == 401
        assert (await client.post("/start_profile")).status_code == 401

        r = await client.post("/console/logout")
        assert r.status_code == 303 and "Max-Age=0" in r.headers["set-cookie"]
        assert (await client.get("/console/api/overview")).status_code == 401
        # the old token is dead even if a client keeps sending it
        client.cookies.set(COOKIE, cookie.split(";")[0].split("=", 1)[1])
        assert (await client.get("/console/api/overview")).status_code == 401
        # scripts may use the admin key itself
        r = await client.get("/console/api/overview", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200


@pytest.mark.asyncio
async def test_the_pages_json_after_traffic(tmp_path: Path) -> None:
    sim = SimulatedConfig(max_model_len=256, ttft=0.01, itl=0.002)
    async with running_app(settings(tmp_path, usage_db="none"), sim=sim) as (client, _):
        assert (await login(client, ADMIN)).status_code == 303
        before = (await client.get("/console/api/history")).json()
        assert before["totals"]["requests"] == 0
        auth = {"Authorization": f"Bearer {USER}"}
        for stream in (False, True, False):
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=auth)
            assert r.status_code == 200
        assert (await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=auth)).status_code == 404

        o = (await client.get("/console/api/overview")).json()
        sim_model = next(m for m in o["models"] if m["id"] == "sim")
        assert sim_model["names"] == ["sim", "sim-alias"] and sim_model["backend"] == "local"
        assert [w["state"] for w in sim_model["workers"]] == ["ready"]
        assert sim_model["queue_depth"] == 0 and sim_model["running"] == 0
        assert {m["id"] for m in o["models"]} == {"sim", "emb"}
        assert o["devices"]["readings"] and o["devices"]["readings"][0]["total_bytes"] > 0
        assert o["routes"] == {"aliases": {}, "upstreams": []}

        h = (await client.get("/console/api/history")).json()
        assert h["totals"]["requests"] == 4 and h["totals"]["errors"] == 1
        assert h["totals"]["completion_tokens"] == 18
        ttfts = [v for v in h["ttft"]["p50"] if v is not None]
        assert ttfts and min(ttfts) >= 0.01  # the simulated engine's own TTFT at least
        assert [v for v in h["itl"]["p50"] if v is not None]
        assert sum(h["tokens_per_second"]) > 0 and len(h["t"]) == 360

        recent = (await client.get("/console/api/recent")).json()
        rows: list[dict[str, Any]] = recent["data"]
        assert [x["status"] for x in rows] == [404, 200, 200, 200]  # newest first; no console or admin reads
        assert {x["key"] for x in rows if x["status"] == 200} == {"key-1"}  # a name, never the key
        for r in (o, h, recent):
            no_keys(str(r))
        assert "must stay private" not in str(recent)

        usage = (await client.get("/console/api/usage", params={"from": "2026-01-01T00:00:00Z", "to": "2027-01-01T00:00:00Z"}))
        assert usage.status_code == 200  # the ledger is off: /admin/usage answers 404
        assert usage.json() == {"object": "console.usage", "ledger": "off", "usage": [], "budgets": []}


@pytest.mark.asyncio
async def test_usage_per_key_against_its_budget(tmp_path: Path) -> None:
    async with running_app(settings(tmp_path, usage_flush_interval=0.05)) as (client, _):
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await client.put("/admin/budgets/key-1", json={"tokens_per_day": 5000}, headers=admin)
        assert r.status_code == 200, r.text
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {USER}"})
            assert r.status_code == 200
        assert (await login(client, ADMIN)).status_code == 303
        window = {"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z"}
        body: dict[str, Any] = {}
        rows: dict[str, Any] = {}

        async def written() -> bool:  # the ledger writes in batches, off the request path
            nonlocal body, rows
            body = (await client.get("/console/api/usage", params=window)).json()
            rows = {u["group"]: u for u in body["usage"]}
            return "key-1" in rows and rows["key-1"]["requests"] == 3

        await wait_until(written, timeout=20, what="the ledger to hold key-1's 3 requests", interval=0.05)
        assert body["ledger"] == "on"
        assert rows["key-1"]["requests"] == 3 and rows["key-1"]["completion_tokens"] == 18
        (b,) = [b for b in body["budgets"] if b["key"] == "key-1"]
        (tokens,) = b["budgets"]
        assert tokens["name"] == "tokens_per_day" and tokens["limit"] == 5000 and tokens["used"] > 0
        no_keys(str(body))


@pytest.mark.asyncio
async def test_open_server_console_is_open_like_the_admin_routes(tmp_path: Path) -> None:
    async with running_app(Settings(access_log_format="off", data_dir=tmp_path)) as (client, _):
        r = await client.get("/console")
        assert r.status_code == 200 and "console.js" in r.text
        assert (await client.get("/console/api/overview")).status_code == 200
        assert (await client.get("/console/static/uPlot.iife.min.js")).status_code == 200
        assert (await client.get("/console/static/uPlot.LICENSE")).status_code == 200


@pytest.mark.asyncio
async def test_worker_states_and_queue_by_priority(tmp_path: Path) -> None:
    from server.console.overview import models

    # a hung engine with one slot: its readiness probe gives up at once, so
    # the worker runs but is not ready, and what is admitted never ends
    sim = SimulatedConfig(max_model_len=256, hang=True)
    async with running_app(settings(tmp_path), sim=sim, embed=False, slots=1, probe_timeout=0.01) as (client, app):
        gw = app.state.gateway
        (pool,) = gw.pools
        auth = {"Authorization": f"Bearer {USER}"}

        def send(prio: int) -> asyncio.Future[Any]:
            return asyncio.ensure_future(
                client.post("/v1/chat/completions", json={**CHAT, "priority": prio}, headers=auth)
            )

        tasks = [send(0)]
        await wait_until(lambda: pool.running == 1, what="the first request on the only slot")
        tasks += [send(5), send(0)]
        await wait_until(lambda: pool.queue_depth == 2, what="two queued requests")
        (m,) = models(gw)
        assert m["queue_by_priority"] == {"0": 1, "5": 1} and m["queue_depth"] == 2 and m["running"] == 1
        assert m["workers"] == [{"index": 0, "state": "not_ready", "in_flight": 1, "slots": 1, "restarts": 0}]
        w = pool.workers[0]
        w.alive = False  # as supervision marks a dead engine while it restarts it
        try:
            assert models(gw)[0]["workers"][0]["state"] == "restarting"
        finally:
            w.alive = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_a_wheel_ships_the_console_files(tmp_path: Path) -> None:
    """A non-editable install serves the page too: the wheel holds the
    pages, the script, the styles and uPlot with its license."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from support import REPO

    src = tmp_path / "src"
    for part in ("server", "engine_adapter"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src),
         "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("npu_gateway-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = REPO / "server" / "console"
    expected = {f"server/console/{p.relative_to(static).as_posix()}"
                for p in (*static.glob("pages/*.html"), *static.glob("static/*"))}
    assert len(expected) >= 7 and expected <= names, sorted(expected - names)
