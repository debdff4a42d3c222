"""Running admitted requests of a WorkerPool: a producer task pumps a local
engine's deltas into the request's channel, or a node's answer is relayed as
it comes. A client disconnect, the request deadline and shutdown all cancel
the producer, which aborts the engine request.

A `Runner` is owned by its pool and given what it needs: the pool's name
(for logs), `on_dead` (the supervisor's: a worker whose engine died) and
`accepting` (whether the pool still serves: a cancel while draining says
so). It never touches slots: the lease (engine_adapter/lease.py) alone
releases them, after the run ends.

Each local request's deltas travel in a `Channel` from the producer task
to the HTTP consumer. It is a deque and one waiter future, not an
`asyncio.Queue`: the producer puts one item per engine step, the consumer
takes everything that is ready in one wake-up (a slow consumer then writes
one batch, not one socket write per token). It has one consumer and no
bound: the producer is the engine, whose output per request is bounded by
`max_tokens`. END and TICK (the idle ticker's) are its sentinels."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import KW_ONLY, dataclass, field

from engine_adapter.errors import EngineDead, EngineError, GatewayError, RequestTimeout, ShuttingDown
from engine_adapter.lease import Slot, Worker
from engine_adapter.types import EngineOutput, GenerationRequest, RelayCall, RelayUsage

logger = logging.getLogger("engine_adapter.pool")

END = object()
TICK = object()


class Channel:
    """The per-request channel from an engine's producer task to the HTTP
    consumer (see the module's doc)."""

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


def _no_observe(index: int, tokens: Sequence[int], cached: int) -> None:
    pass


def _no_settle(index: int, tokens: Sequence[int]) -> None:
    pass


@dataclass(eq=False)
class Runner:
    name: str
    _: KW_ONLY
    on_dead: Callable[[Worker, BaseException], None]
    accepting: Callable[[], bool]
    # what the engine's prefix cache held for a request (its first output):
    # the routing policy's check of its prediction (kv-events)
    observe: Callable[[int, Sequence[int], int], None] = _no_observe
    # a request that ended before its first output (error, cancel, abort)
    settle: Callable[[int, Sequence[int]], None] = _no_settle
    _running: int = field(default=0, init=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def running(self) -> int:
        """Requests running now (streams, relays, embeddings)."""
        return self._running

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def begin(self) -> None:
        self._running += 1
        self._idle.clear()

    def end(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._idle.set()

    async def relay(self, slot: Slot, call: RelayCall) -> AsyncGenerator[bytes | RelayUsage, None]:
        """Relay the node's answer to `call` (the lease releases the slot)."""
        self.begin()
        try:
            async with aclosing(slot.opened.items()) as items:
                async for item in items:
                    yield item
        finally:
            self.end()

    async def run(
        self, slot: Slot, req: GenerationRequest, idle_tick: float | None = None
    ) -> AsyncGenerator[list[EngineOutput] | None, None]:
        """Run an admitted request on its slot's worker: its deltas in lists
        of what was ready together (one engine step each when the consumer
        keeps up). Errors are `GatewayError`s. With `idle_tick`, yields None
        whenever nothing came for that many seconds (SSE keep-alives). The
        lease releases the slot once this ends, however it ends."""
        w = slot.worker
        channel = Channel()
        ticker = Ticker(channel, idle_tick) if idle_tick else None
        producer = asyncio.ensure_future(self._pump(w, req, channel))
        w.tasks.add(producer)
        self.begin()
        timer: asyncio.TimerHandle | None = None
        if req.deadline is not None:
            loop = asyncio.get_running_loop()
            delay = req.deadline - time.monotonic()
            timer = loop.call_later(max(0.0, delay), self._expire, producer, channel, req)
        try:
            while True:
                batch: list[EngineOutput] = []
                ended: BaseException | None = None
                finished = ticked = False
                for item in await channel.take():
                    if isinstance(item, EngineOutput):
                        batch.append(item)
                    elif item is TICK:
                        ticked = True
                    elif item is END:
                        finished = True
                        break
                    elif isinstance(item, BaseException):
                        ended = item
                        break
                if batch:
                    if ticker is not None:
                        ticker.seen = True
                    yield batch
                elif ticked and not finished and ended is None:
                    yield None
                if ended is not None:
                    raise ended
                if finished:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if ticker is not None:
                ticker.stop()
            if not producer.done():
                producer.cancel()
                try:
                    await asyncio.shield(producer)
                except BaseException:
                    pass
            w.tasks.discard(producer)
            self.end()

    def _expire(self, producer: asyncio.Task[None], channel: Channel, req: GenerationRequest) -> None:
        if not producer.done():
            producer.cancel()
            channel.put(RequestTimeout("the request exceeded the gateway's request timeout and was aborted"))

    async def _pump(self, w: Worker, req: GenerationRequest, channel: Channel) -> None:
        put = channel.put
        first = True
        try:
            async for out in w.engine.generate(req):
                w.saw_output()
                if first:
                    first = False
                    self.observe(w.index, req.prompt_token_ids, out.cached_tokens)
                put(out)
            w.last_ready = time.monotonic()
            put(END)
        except asyncio.CancelledError:
            await w.abort_quietly(req.request_id)
            if not self.accepting():
                put(ShuttingDown("the server shut down before the request finished"))
            raise
        except GatewayError as e:
            if isinstance(e, EngineDead):
                self.on_dead(w, e)
            put(e)
        except Exception as e:  # an engine bug must not hang the client
            logger.exception("%s worker %d: generate failed", self.name, w.index)
            put(EngineError(f"engine error: {type(e).__name__}"))
        finally:
            if first:
                self.settle(w.index, req.prompt_token_ids)
