"""What a WorkerPool keeps per worker (a waiting request: engine_adapter/scheduler.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from engine_adapter.types import Engine

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Worker:
    index: int
    engine: Engine
    slots: int  # what ordinary requests may use
    in_flight: int = 0  # every slot taken, reserve slots included
    # extra slots (--fair-reserve-slots; the engine runs slots + reserve) that
    # admission hands only to a key's new flow (engine_adapter/admission.py)
    reserve: int = 0
    reserved: int = 0  # reserve slots taken
    alive: bool = False
    restarts: int = 0
    last_ready: float | None = None  # monotonic time of the last good probe (or finished request)
    last_output: float | None = None  # monotonic time the engine last produced output (saw_output)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def free(self) -> int:
        """Ordinary slots free (a reserve slot taken leaves these as they are)."""
        return self.slots - (self.in_flight - self.reserved) if self.alive else 0

    @property
    def reserve_free(self) -> int:
        return self.reserve - self.reserved if self.alive else 0

    def saw_output(self, now: float | None = None) -> None:
        """The engine just produced output (a delta, an embedding): with a
        passive readiness probe that counts as a good probe, so a busy engine
        gets no probe requests."""
        self.last_output = time.monotonic() if now is None else now

    def last_sign_of_life(self, passive: bool) -> float | None:
        """When this worker last showed it serves: a good probe or a finished
        request, and with `passive` also any output."""
        if passive and self.last_output is not None:
            if self.last_ready is None or self.last_output > self.last_ready:
                return self.last_output
        return self.last_ready

    async def abort_quietly(self, request_id: str) -> None:
        """Abort an engine request; a failure (engine gone) is only logged."""
        try:
            await self.engine.abort(request_id)
        except Exception:
            logger.debug("abort of %s failed", request_id, exc_info=True)


@dataclass(slots=True)
class PoolCounters:
    rejected: Counter[str] = field(default_factory=Counter)
    queue_time_total: float = 0.0
    dispatched: int = 0
