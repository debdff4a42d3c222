"""The usage ledger as the console sees it: `GET /admin/usage?group_by=key`
and `GET /admin/budgets` (server/usage/), asked in process through the
app itself, so the console depends on those endpoints' JSON only, and a
ledger that is off (or absent: 404) reads as `{"ledger": "off"}`."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import Request

# What authenticated the console's own request, passed on as it came.
_FORWARD = ("cookie", "authorization", "api-key", "x-api-key")


async def ledger_usage(request: Request, since: str, until: str) -> dict[str, Any]:
    headers = {h: request.headers[h] for h in _FORWARD if h in request.headers}
    transport = httpx.ASGITransport(app=request.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console.local", headers=headers) as client:
        usage = await client.get("/admin/usage", params={"group_by": "key", "from": since, "to": until})
        budgets = await client.get("/admin/budgets")
    if usage.status_code == 404 or budgets.status_code == 404:
        return {"object": "console.usage", "ledger": "off", "usage": [], "budgets": []}
    for r in (usage, budgets):
        if r.status_code != 200:
            return {"object": "console.usage", "ledger": "error", "status": r.status_code, "usage": [], "budgets": []}
    return {
        "object": "console.usage",
        "ledger": "on",
        "from": usage.json().get("from"),
        "to": usage.json().get("to"),
        "usage": usage.json().get("data", []),
        "budgets": budgets.json().get("data", []),
    }
