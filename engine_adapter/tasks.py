"""Stopping background tasks so that a stop always ends.

Python 3.11's `asyncio.wait_for` swallows a cancellation that lands in the
same loop turn as its inner awaitable completes (CPython gh-86296, fixed in
3.12 by rebuilding `wait_for` on `asyncio.timeout`). A long-lived loop that
calls `wait_for` (a device probe, a health check) then runs on after
`task.cancel()`, and a plain `task.cancel(); await task` waits for ever:
seen as a test session hung in a gateway's shutdown, its device monitor
"cancelling" in its next sleep for 26 minutes. `cancel_and_wait` cancels
again until the tasks are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], retry: float = 0.2) -> None:
    """Cancel `tasks` and return once every one is done, cancelling again
    every `retry` seconds while one is not. Their results and exceptions are
    retrieved (and dropped): a stop reports nothing. A cancellation of the
    caller still propagates."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry)
    for t in tasks:
        if not t.cancelled():
            t.exception()
