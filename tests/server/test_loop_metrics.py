"""`npugw_asyncio_tasks`: the event loop's live task count, read at scrape
time (the soak benchmark and the CI leak check watch it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest
from sim_app import running_app
from support import metric_value, wait_until

from engine_adapter.backends.simulated import SimulatedConfig


async def _tasks(client: httpx.AsyncClient) -> float:
    return metric_value((await client.get("/metrics")).text, "npugw_asyncio_tasks")


async def _poll(read: Callable[[], Awaitable[float]], ok: Callable[[float], bool], what: str) -> None:
    seen: list[float] = []

    async def holds() -> bool:
        seen.append(await read())
        return ok(seen[-1])

    await wait_until(holds, timeout=10, what=lambda: f"{what} (values seen: {seen[-5:]})", interval=0.01)


@pytest.mark.asyncio
async def test_asyncio_tasks_gauge_follows_open_requests() -> None:
    async with running_app(embed=False) as (client, _):
        for e in client.engines:  # type: ignore[attr-defined]
            e.config = SimulatedConfig(max_model_len=256, hang=True)  # after its start-up probe
        before = await _tasks(client)
        assert before >= 1  # at least the scrape itself
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        n = 20
        # hung engine: every request stays open until cancelled; each is at
        # least one task (over ASGITransport the client's task runs the app)
        pending = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(n)]
        try:
            await _poll(lambda: _tasks(client), lambda v: v >= before + n, f"{n} more tasks than {before}")
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await _poll(lambda: _tasks(client), lambda v: v <= before, f"the task count back at {before}")
