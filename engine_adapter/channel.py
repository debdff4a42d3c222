"""The per-request channel between an engine's producer task and the HTTP
consumer: end and idle-tick sentinels, and the idle ticker."""

from __future__ import annotations

import asyncio

END = object()
TICK = object()


class Ticker:
    """Puts TICK into a channel whenever nothing else came for `every` s."""

    __slots__ = ("_handle", "_loop", "channel", "every", "seen")

    def __init__(self, channel: asyncio.Queue[object], every: float) -> None:
        self.channel = channel
        self.every = every
        self.seen = False
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(every, self._fire)

    def _fire(self) -> None:
        if not self.seen:
            self.channel.put_nowait(TICK)
        self.seen = False
        self._handle = self._loop.call_later(self.every, self._fire)

    def stop(self) -> None:
        self._handle.cancel()
