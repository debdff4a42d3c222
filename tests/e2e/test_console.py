"""The console in a real browser: headless Chromium (Debian's `chromium`,
driven by Playwright) against a real gateway process on the simulated
engine (the console reads the gateway, not the engine).

What a person would check: the sign-in form refuses a wrong key and a
client key, takes the admin key, and the page then loads with no console
error; after traffic its numbers, tables and all three plots change; the
session cookie is HttpOnly and SameSite=Strict and out of the page's
reach; no key (admin or client) is in the page or in anything it reads;
signing out ends the session. A screenshot is written to the test's
folder, and to docs/console.png with NPUGW_CONSOLE_SCREENSHOT=1.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import REPO, GatewayProcess

pytestmark = [pytest.mark.e2e]

ADMIN = "sk-admin-console-e2e-5d81c0"
USER = "sk-user-console-e2e-a4f902"
GATEWAY_ARGS = [
    "--api-key", USER, "--admin-api-key", ADMIN, "--access-log-format", "off",
    "--simulated-ttft", "0.02", "--simulated-itl", "0.004", "--usage-flush-interval", "0.1",
]
WAIT_MS = 30_000  # a deadline for a hung page, not a timing assertion
CANVASES = "() => [...document.querySelectorAll('.plot canvas')].map((c) => c.toDataURL())"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run scripts/test-services.sh (apt-get install chromium)", pytrace=False)
    return found


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # the system's Chromium (no browser download); as root it needs --no-sandbox
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def traffic(gw: GatewayProcess, n: int, max_tokens: int) -> int:
    """`n` chat requests, every other one streamed; the tokens (prompt and
    completion) the gateway reported for them."""
    auth = {"Authorization": f"Bearer {USER}"}
    total = 0
    with httpx.Client(base_url=gw.url, headers=auth, timeout=30) as c:
        for i in range(n):
            body: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": f"secret prompt {i}"}],
                                    "max_tokens": max_tokens}
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            if i % 2:
                chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                total += next(ch["usage"]["total_tokens"] for ch in chunks if ch.get("usage"))
            else:
                total += r.json()["usage"]["total_tokens"]
    return total


def open_page(browser: Any) -> tuple[Any, Any, list[str]]:
    """A fresh context and page, and the list its console errors and page
    errors go to."""
    context = browser.new_context(viewport={"width": 1400, "height": 1250})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    return context, page, problems


def sign_in(page: Any, gw: GatewayProcess) -> None:
    page.goto(gw.url + "/console")
    page.fill("#key", ADMIN)
    page.click("#login")
    page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 1", timeout=WAIT_MS)


def test_console_in_a_browser(sim_gateways: Callable[..., list[GatewayProcess]], browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    (gw,) = sim_gateways([*GATEWAY_ARGS, "--data-dir", str(tmp_path / "data")])
    r = httpx.put(gw.url + "/admin/budgets/key-1", json={"tokens_per_day": 100_000},
                  headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    context, page, problems = open_page(browser)

    # --- the sign-in form refuses a wrong key and a client key
    page.goto(gw.url + "/console")
    expect(page.locator("#key")).to_be_visible()
    for wrong in ("not-the-admin-key", USER):
        page.fill("#key", wrong)
        page.click("#login")
        expect(page.locator("#login-error")).to_be_visible()
        assert not [c for c in context.cookies() if c["name"] == "npugw_console"]
        assert context.request.get(gw.url + "/console/api/overview").status == 401
    # the refused sign-ins answered 401, which Chromium reports as a failed
    # resource load; the page itself must load with no error at all
    assert all("status of 401" in p for p in problems), problems
    problems.clear()

    # --- the admin key opens the console
    page.fill("#key", ADMIN)
    page.click("#login")
    page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 1", timeout=WAIT_MS)
    (cookie,) = [c for c in context.cookies() if c["name"] == "npugw_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "npugw_console" not in page.evaluate("() => document.cookie")
    expect(page.locator("#models")).to_contain_text("#0 ready")
    expect(page.locator("#devices")).to_contain_text("cpu")
    expect(page.locator("#n-requests")).to_have_text("0")
    expect(page.locator("#recent")).to_contain_text("no requests yet")
    plots_before = page.evaluate(CANVASES)
    assert len(plots_before) == 3
    for plot in ("#plot-ttft", "#plot-itl", "#plot-tps"):
        expect(page.locator(plot)).to_have_attribute("data-points", "0")

    # --- after traffic the numbers, the tables and every plot change
    n, max_tokens = 12, 16
    tokens = traffic(gw, n, max_tokens)
    expect(page.locator("#n-requests")).to_have_text(str(n), timeout=WAIT_MS)
    expect(page.locator("#n-tokens")).to_have_text(str(n * max_tokens), timeout=WAIT_MS)
    expect(page.locator("#n-ttft")).not_to_have_text("-")
    expect(page.locator("#recent tbody tr")).to_have_count(n, timeout=WAIT_MS)
    expect(page.locator("#recent")).to_contain_text("/v1/chat/completions")
    expect(page.locator("#recent")).to_contain_text("key-1")
    # every plot has points now (the TTFT and ITL plots three percentiles
    # each), and draws something else than before
    for plot in ("#plot-ttft", "#plot-itl", "#plot-tps"):
        expect(page.locator(plot)).not_to_have_attribute("data-points", "0", timeout=WAIT_MS)
    page.wait_for_function(
        f"(before) => ({CANVASES})().every((url, i) => url !== before[i])", arg=plots_before, timeout=WAIT_MS
    )
    # usage per key against its budget (the ledger writes in batches: the
    # page shows them within a refresh or two of the ledger's write)
    usage_row = page.locator("#usage tbody tr", has_text="key-1")
    expect(usage_row).to_contain_text(f"{tokens:,} / 100,000", timeout=2 * WAIT_MS)  # tokens_per_day: used / limit
    expect(usage_row.locator("td").nth(1)).to_have_text(str(n))

    page.screenshot(path=str(tmp_path / "console.png"), full_page=True)
    if os.environ.get("NPUGW_CONSOLE_SCREENSHOT") == "1":
        page.screenshot(path=str(REPO / "docs" / "console.png"), full_page=True)

    # --- no key anywhere the page can see: its source, its files, its JSON
    seen = [page.content()]
    for path in ("/console", "/console/static/console.js", "/console/api/overview", "/console/api/history",
                 "/console/api/recent?limit=1000", "/console/api/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z"):
        r = context.request.get(gw.url + path)
        assert r.status == 200, path
        seen.append(r.text())
    for text in seen:
        assert ADMIN not in text and USER not in text
        assert "secret prompt" not in text
    assert problems == []

    # --- signing out ends the session
    page.click("#logout")
    expect(page.locator("#key")).to_be_visible()
    assert context.request.get(gw.url + "/console/api/overview").status == 401
    assert problems == []
    context.close()


def test_console_with_the_ledger_off(
    sim_gateways: Callable[..., list[GatewayProcess]], browser: Any, tmp_path: Path
) -> None:
    """`--usage-db none`: the ledger's endpoints answer 404; the page says
    the ledger is off, and shows no error for it."""
    from playwright.sync_api import expect

    (gw,) = sim_gateways([*GATEWAY_ARGS, "--usage-db", "none", "--data-dir", str(tmp_path / "data")])
    context, page, problems = open_page(browser)
    sign_in(page, gw)
    expect(page.locator("#usage-note")).to_have_text("usage ledger off")
    expect(page.locator("#usage")).to_contain_text("usage ledger off")
    traffic(gw, 2, 4)
    expect(page.locator("#n-requests")).to_have_text("2", timeout=WAIT_MS)
    assert problems == []
    context.close()
