"""Supervision and readiness of a WorkerPool's workers: a dead worker is
restarted with back-off (its in-flight requests already failed cleanly), and
readiness means a real generation recently (a probe, or with passive
readiness any output the engine produced).

A `Supervisor` is owned by its pool and given what it needs: the workers, the
engine factory, `spawn` (a background task the pool stops with itself),
`accepting` (whether the pool still serves: no restart while draining),
`forget` (the routing policy's: a dead worker's KV cache goes with it) and
`wake` (a restarted worker takes the waiting requests)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass

from engine_adapter.errors import EngineDead
from engine_adapter.lease import Worker
from engine_adapter.readiness import probe_once
from engine_adapter.types import Engine

logger = logging.getLogger("engine_adapter.pool")

EngineFactory = Callable[[int], Engine]


@dataclass(eq=False)
class Supervisor:
    name: str
    workers: list[Worker]
    factory: EngineFactory
    _: KW_ONLY
    spawn: Callable[[Awaitable[None]], None]
    accepting: Callable[[], bool]
    forget: Callable[[int], None]
    wake: Callable[[Worker], None]
    readiness_interval: float = 5.0
    probe_timeout: float | None = None  # None: the readiness interval
    restart_backoff: tuple[float, float] = (1.0, 30.0)
    # Passive readiness: output the engine produced (Worker.saw_output)
    # counts as a good probe, so an engine busy with real requests gets no
    # probe requests, and an idle one is probed once per interval and stays
    # ready for 1.5 intervals after its last sign of life. Each probe keeps a
    # vLLM worker busy-polling its shared-memory queue for ~1 s afterwards
    # (vLLM's SpinCondition), so an idle engine probed every half interval
    # took ~0.4 of a core from the engines that serve. A hung engine turns
    # not-ready at most 1.5 intervals (7.5 s at the default 5 s) after its
    # last output or probe. False (`--readiness-probe active`), the old rule:
    # only probes and finished requests count, idle engines are probed twice
    # per interval, ready for one interval.
    passive_readiness: bool = True

    def __post_init__(self) -> None:
        if self.probe_timeout is None:
            self.probe_timeout = self.readiness_interval

    def on_dead(self, w: Worker, err: BaseException) -> None:
        if not w.alive:
            return
        logger.error("%s worker %d died: %s; restarting", self.name, w.index, err)
        w.alive = False
        w.last_ready = None
        self.forget(w.index)  # its KV cache goes with it
        for t in list(w.tasks):
            t.cancel()
        if self.accepting():
            self.spawn(self.restart(w))

    async def restart(self, w: Worker) -> None:
        delay, cap = self.restart_backoff
        try:
            await w.engine.stop()
        except Exception:
            logger.debug("stopping dead engine failed", exc_info=True)
        while self.accepting():
            # The new engine takes the worker's place once it runs: while it
            # starts (~20 s on CPU, the event loop serving), the old one's card
            # and tokenizer answer what the pool is asked (`pool.card`).
            engine = self.factory(w.index)
            try:
                await engine.start()
            except Exception:
                logger.exception("%s worker %d failed to restart; retry in %.0fs", self.name, w.index, delay)
                try:
                    await engine.stop()
                except Exception:
                    logger.debug("stopping the engine that failed to start failed", exc_info=True)
                await asyncio.sleep(delay)
                delay = min(cap, delay * 2)
                continue
            except asyncio.CancelledError:  # a stop during the restart: nothing it started outlives it
                await asyncio.shield(engine.stop())
                raise
            w.engine = engine
            w.alive = True
            w.restarts += 1
            logger.info("%s worker %d restarted", self.name, w.index)
            await self.probe(w)
            self.wake(w)  # waiters that can now be served
            return

    async def probe(self, w: Worker) -> None:
        """A real 1-token generation (or a health call for embedding models)."""
        if not w.alive:
            return
        try:
            await asyncio.wait_for(probe_once(w.engine, self.name), self.probe_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            logger.warning("%s worker %d: readiness probe timed out", self.name, w.index)
            return
        except EngineDead as e:
            self.on_dead(w, e)
            return
        except Exception as e:
            logger.warning("%s worker %d: readiness probe failed: %s", self.name, w.index, e)
            return
        w.last_ready = time.monotonic()

    def ready_window(self) -> float:
        return self.readiness_interval * (1.5 if self.passive_readiness else 1.0)

    async def probe_loop(self, w: Worker) -> None:
        half = self.readiness_interval / 2
        stale_after = self.readiness_interval if self.passive_readiness else half
        while True:
            await asyncio.sleep(half)
            seen = w.last_sign_of_life(self.passive_readiness)
            fresh = seen is not None and time.monotonic() - seen < stale_after
            if w.alive and not fresh:
                await self.probe(w)

    def alive_workers(self) -> int:
        return sum(1 for w in self.workers if w.alive)

    def ready_workers(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        n = 0
        for w in self.workers:
            seen = w.last_sign_of_life(self.passive_readiness)
            if w.alive and seen is not None and now - seen <= self.ready_window():
                n += 1
        return n

