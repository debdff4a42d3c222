"""The per-request channel between an engine's producer task and the HTTP
consumer: end and idle-tick sentinels, the idle ticker, and the channel
itself.

The channel is a deque and one waiter future, not an `asyncio.Queue`: the
producer puts one item per engine step, the consumer takes everything that
is ready in one wake-up (a slow consumer then writes one batch, not one
socket write per token). It has one consumer and no bound: the producer is
the engine, whose output per request is bounded by `max_tokens`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

END = object()
TICK = object()


class Channel:
    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[object]:
        """Everything put since the last call (at least one item)."""
        while not self._items:
            waiter = self._loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class Ticker:
    """Puts TICK into a channel whenever nothing else came for `every` s."""

    __slots__ = ("_handle", "_loop", "channel", "every", "seen")

    def __init__(self, channel: Channel, every: float) -> None:
        self.channel = channel
        self.every = every
        self.seen = False
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(every, self._fire)

    def _fire(self) -> None:
        if not self.seen:
            self.channel.put(TICK)
        self.seen = False
        self._handle = self._loop.call_later(self.every, self._fire)

    def stop(self) -> None:
        self._handle.cancel()


async def flatten(batches: AsyncIterator[list[T] | None]) -> AsyncIterator[T | None]:
    """One item at a time from a stream of batches (None passes through)."""
    try:
        async for batch in batches:
            if batch is None:
                yield None
                continue
            for item in batch:
                yield item
    finally:
        close = getattr(batches, "aclose", None)
        if close is not None:
            await close()
