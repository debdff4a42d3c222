"""Leases: the result of admission.

`await pool.acquire(ask)` (a WorkerPool or a Router) waits for an engine
slot for each request of one client request (one per prompt), or raises a
`GatewayError` kind (queue full, queue timeout, no live engine, draining).
Only once it returns does the HTTP layer start its response, so every
refusal is a status, never a stream that begins and then fails.

A lease knows which served model answers (`served_by`) and runs its requests
with `stream()`: the engines' deltas in batches, tagged with the prompt's
index, or None as an idle tick. The lease alone gives slots back: each
one as its request's stream or relay ends, however it ends, and
`release()` those never streamed; it is idempotent and always safe to call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from engine_adapter.errors import InvalidRequest
from engine_adapter.tasks import cancel_and_wait
from engine_adapter.types import EngineOutput, GenerationRequest, RelayCall, RelayUsage

if TYPE_CHECKING:
    from engine_adapter.workers import Worker

Batch = list[EngineOutput] | None
Tagged = tuple[int, Batch]


Relayed = bytes | RelayUsage
Request = GenerationRequest | RelayCall


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


class Lease(Protocol):
    @property
    def served_by(self) -> str: ...

    @property
    def requests(self) -> Sequence[Request]: ...

    @property
    def relayed(self) -> bool: ...

    @property
    def upstream(self) -> str | None:
        """The URL of the node a passed-through request went to."""
        ...

    def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]: ...

    def relay(self) -> AsyncGenerator[Relayed, None]: ...

    def release(self) -> None: ...


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


class PoolLease:
    """Slots on the workers of one WorkerPool, one per request."""

    __slots__ = ("_held", "_relay", "_release", "_run", "requests", "served_by", "upstream")

    def __init__(
        self,
        served_by: str,
        held: list[tuple[Request, Slot]],
        run: Callable[[Slot, GenerationRequest, float | None], AsyncGenerator[Batch, None]],
        relay: Callable[[Slot, RelayCall], AsyncGenerator[Relayed, None]],
        release: Callable[[Slot], None],
    ) -> None:
        self.served_by = served_by
        self.requests = [r for r, _ in held]
        ep = getattr(held[0][1].opened, "ep", None) if held else None
        self.upstream: str | None = getattr(ep, "url", None)
        self._held = held
        self._run = run
        self._relay = relay
        self._release = release

    @property
    def relayed(self) -> bool:
        return bool(self.requests) and isinstance(self.requests[0], RelayCall)

    def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        held, self._held = self._held, []
        runs = [(i, self._run_then_release(slot, req, idle_tick)) for i, (req, slot) in enumerate(held)
                if isinstance(req, GenerationRequest)]
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
        self, runs: list[tuple[int, AsyncGenerator[Batch, None]]], held: list[tuple[Request, Slot]]
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

    async def relay(self) -> AsyncGenerator[Relayed, None]:
        held, self._held = self._held, []
        try:
            ((call, slot),) = held
            assert isinstance(call, RelayCall)
            async with aclosing(self._relay(slot, call)) as items:
                async for item in items:
                    yield item
        finally:
            for _, slot in held:
                self._release(slot)

    def release(self) -> None:
        held, self._held = self._held, []
        for _, slot in held:
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
