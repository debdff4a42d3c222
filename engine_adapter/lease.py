"""Leases: the result of admission.

`await pool.acquire(ask)` (a WorkerPool, a Router, a LoRA adapter's pool)
waits for an engine slot for each request of one client request (one per
prompt), or raises a `GatewayError` kind (queue full, queue timeout, no live
engine, draining). Only once it returns does the HTTP layer start its
response, so every refusal is a status, never a stream that begins and then
fails.

Admission returns one of two kinds of lease, and the HTTP layer dispatches
once on which (server/generation.py `admit`):

- `LocalLease`: requests tokenized for a local engine; `stream()` runs them
  and gives the engines' deltas in batches, tagged with the prompt's index,
  or None as an idle tick;
- `RelayLease`: one pass-through call that an upstream node accepted;
  `relay()` gives the node's bytes (and the usage it reports).

Both know which served model answers (`served_by`). The lease alone gives
slots back: each one as its request's stream or relay ends, however it
ends, and `release()` those never streamed; it is idempotent and always
safe to call. The two kinds are abstract base classes, not runtime
Protocols: the dispatch is an `isinstance` on every request, which costs
about 0.1 us on a class and about 20 us on a runtime-checkable Protocol.

What a pool's lease holds is here too: `Worker` (what a WorkerPool keeps per
engine instance) and `Slot` (one of a worker's slots, held for one request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine_adapter.errors import InvalidRequest
from engine_adapter.tasks import cancel_and_wait
from engine_adapter.types import Engine, EngineOutput, GenerationRequest, RelayCall, RelayUsage

logger = logging.getLogger(__name__)

Batch = list[EngineOutput] | None
Tagged = tuple[int, Batch]


Relayed = bytes | RelayUsage


class Ask(Protocol):
    """What a route asks of whichever target admission picks, in the form
    that target takes: generation requests for a local engine (tokenized
    with its tokenizer), or one pass-through call for upstream nodes."""

    def local(self, pool: Any, model: str) -> list[GenerationRequest]: ...

    def relay(self, model: str) -> RelayCall: ...


class Prepared:
    """An Ask of requests built before admission (a probe, a test, a route
    that tokenized already): local engines only."""

    __slots__ = ("requests",)

    def __init__(self, requests: Sequence[GenerationRequest]) -> None:
        self.requests = list(requests)

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        return [r if r.model == model else replace(r, model=model) for r in self.requests]

    def relay(self, model: str) -> RelayCall:
        raise InvalidRequest(f"model {model!r} is passed through to its nodes")

    def budget(self) -> int:
        """Tokens reserved at admission: prompt + max_tokens x n."""
        return sum(len(r.prompt_token_ids) + r.sampling.max_tokens * r.sampling.n for r in self.requests)


class Held(ABC):
    """What both kinds of lease are: admitted on a served model
    (`served_by`), given back with `release()`."""

    __slots__ = ()

    @property
    @abstractmethod
    def served_by(self) -> str: ...

    @abstractmethod
    def release(self) -> None: ...


class LocalLease(Held):
    """Slots on local engines, one per request (see the module's doc)."""

    __slots__ = ()

    @property
    @abstractmethod
    def requests(self) -> Sequence[GenerationRequest]: ...

    @abstractmethod
    def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]: ...


class RelayLease(Held):
    """One call passed through to an upstream node that accepted it (see
    the module's doc)."""

    __slots__ = ()

    @property
    @abstractmethod
    def call(self) -> RelayCall: ...

    @property
    @abstractmethod
    def upstream(self) -> str | None:
        """The URL of the node the call went to."""

    @abstractmethod
    def relay(self) -> AsyncGenerator[Relayed, None]: ...


Lease = LocalLease | RelayLease


class WrappedLocal(LocalLease):
    """A local lease around another one (`_inner`, a slot of the subclass):
    the requests and the release are the inner lease's; the subclass says
    what `stream()` adds."""

    __slots__ = ()
    _inner: LocalLease

    @property
    def requests(self) -> Sequence[GenerationRequest]:
        return self._inner.requests

    def release(self) -> None:
        self._inner.release()


class WrappedRelay(RelayLease):
    """A relay lease around another one (`_inner`, a slot of the subclass):
    the call, the node and the release are the inner lease's; the subclass
    says what `relay()` adds."""

    __slots__ = ()
    _inner: RelayLease

    @property
    def call(self) -> RelayCall:
        return self._inner.call

    @property
    def upstream(self) -> str | None:
        return self._inner.upstream

    def release(self) -> None:
        self._inner.release()


@dataclass(slots=True)
class Worker:
    """What a WorkerPool keeps per worker (one engine instance); its slots
    are held as `Slot`s."""

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
class Slot:
    """One engine slot held for one request."""

    worker: Worker
    cost: int = 0  # the queue's estimated cost of its request (engine_adapter/scheduler.py)
    tenant: str = ""  # its API key name
    priority: int = 0
    reserve: bool = False  # one of the worker's reserve slots (--fair-reserve-slots)
    released: bool = False
    opened: Any = None  # a relayed call the node accepted (backends/remote.py Opened)


class PoolLease(LocalLease):
    """Slots on the workers of one WorkerPool, one per request."""

    __slots__ = ("_held", "_release", "_run", "requests", "served_by")
    served_by: str
    requests: list[GenerationRequest]

    def __init__(
        self,
        served_by: str,
        held: list[tuple[GenerationRequest, Slot]],
        run: Callable[[Slot, GenerationRequest, float | None], AsyncGenerator[Batch, None]],
        release: Callable[[Slot], None],
    ) -> None:
        self.served_by = served_by
        self.requests = [r for r, _ in held]
        self._held = held
        self._run = run
        self._release = release

    def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        held, self._held = self._held, []
        runs = [(i, self._run_then_release(slot, req, idle_tick)) for i, (req, slot) in enumerate(held)]
        return self._merged(runs, held)

    async def _run_then_release(
        self, slot: Slot, req: GenerationRequest, idle_tick: float | None
    ) -> AsyncGenerator[Batch, None]:
        """One request's run; its slot goes back as soon as the run ends."""
        try:
            async with aclosing(self._run(slot, req, idle_tick)) as run:
                async for batch in run:
                    yield batch
        finally:
            self._release(slot)

    async def _merged(
        self, runs: list[tuple[int, AsyncGenerator[Batch, None]]], held: list[tuple[GenerationRequest, Slot]]
    ) -> AsyncGenerator[Tagged, None]:
        """The runs merged; every slot goes back at the end, also those
        whose run never started."""
        try:
            async with aclosing(merge(runs)) as items:
                async for item in items:
                    yield item
        finally:
            for _, slot in held:
                self._release(slot)

    def release(self) -> None:
        held, self._held = self._held, []
        for _, slot in held:
            self._release(slot)


class PoolRelayLease(RelayLease):
    """A slot of a WorkerPool of upstream nodes, and the call a node
    accepted on it."""

    __slots__ = ("_relay", "_release", "_slot", "call", "served_by", "upstream")
    call: RelayCall
    served_by: str
    upstream: str | None

    def __init__(
        self,
        call: RelayCall,
        slot: Slot,
        relay: Callable[[Slot, RelayCall], AsyncGenerator[Relayed, None]],
        release: Callable[[Slot], None],
    ) -> None:
        self.call = call
        self.served_by = call.model
        self.upstream = getattr(getattr(slot.opened, "ep", None), "url", None)
        self._slot: Slot | None = slot
        self._relay = relay
        self._release = release

    async def relay(self) -> AsyncGenerator[Relayed, None]:
        slot, self._slot = self._slot, None
        if slot is None:
            return
        try:
            async with aclosing(self._relay(slot, self.call)) as items:
                async for item in items:
                    yield item
        finally:
            self._release(slot)

    def release(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            self._release(slot)


async def merge(streams: list[tuple[int, AsyncGenerator[Batch, None]]]) -> AsyncGenerator[Tagged, None]:
    """Interleave several streams of batches, tagging each item with its
    stream's tag; each stream is closed at the end, whatever happened."""
    if len(streams) == 1:
        tag, only = streams[0]
        try:
            async for item in only:
                yield tag, item
        finally:
            await only.aclose()
        return
    queue: asyncio.Queue[Tagged | BaseException | None] = asyncio.Queue()

    async def pump(tag: int, s: AsyncGenerator[Batch, None]) -> None:
        try:
            async with aclosing(s) as it:
                async for item in it:
                    queue.put_nowait((tag, item))
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(tag, s)) for tag, s in streams]
    try:
        live = len(tasks)
        while live:
            got = await queue.get()
            if got is None:
                live -= 1
                continue
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        await cancel_and_wait(tasks)
