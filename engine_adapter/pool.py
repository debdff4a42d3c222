"""The worker pool of one model: bounded queue, admission, priorities, fair
share between keys, deadline-aware admission, dispatch and drain.

A request needs a slot on a worker (at most `slots` run on one engine, plus
its reserve slots for new flows: --fair-reserve-slots). Free slot: it runs
at once on the worker the routing policy picks. Else it waits
in a bounded queue (engine_adapter/scheduler.py: lower `priority` first, as
in vLLM; inside one priority, weighted fair share between API keys, or
arrival order with the `fifo` policy). A full queue rejects at once
(`QueueFull`); a wait past `max_queue_wait` gives `QueueTimeout` and the
request never reaches an engine. A request with a time-to-first-token
deadline whose estimated wait is longer is refused at arrival, and one whose
deadline passes while it waits leaves the queue (`DeadlineUnmeetable`).

The pool owns its parts, each given what it needs: an `Admission`
(engine_adapter/admission.py) hands out slots and keeps the queue, a
`Runner` (engine_adapter/running.py) runs admitted requests, a `Supervisor`
(engine_adapter/supervision.py) restarts dead workers and answers
readiness. Only the lease (engine_adapter/lease.py) gives a slot back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from engine_adapter.admission import Admission
from engine_adapter.errors import (
    EngineDead,
    GatewayError,
    RequestTimeout,
    ShuttingDown,
)
from engine_adapter.lease import Ask, PoolLease, PoolRelayLease, Prepared, Slot, Worker
from engine_adapter.routing.policy import RouteKey, RoutingPolicy
from engine_adapter.running import Runner
from engine_adapter.scheduler import Policy, relay_cost, request_cost
from engine_adapter.supervision import EngineFactory, Supervisor
from engine_adapter.tasks import cancel_and_wait
from engine_adapter.types import (
    Embedded,
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    GenerationRequest,
    ModelCard,
    RelayCall,
    Tokenizer,
)

logger = logging.getLogger(__name__)


class WorkerPool:
    def __init__(
        self,
        name: str,
        factory: EngineFactory,
        *,
        num_workers: int = 1,
        slots_per_worker: int = 256,
        max_queue_size: int = 1024,
        max_queue_wait: float = 60.0,
        readiness_interval: float = 5.0,
        probe_timeout: float | None = None,
        restart_backoff: tuple[float, float] = (1.0, 30.0),
        lazy: bool = False,
        planned_card: ModelCard | None = None,
        queue_policy: Policy = "fair",
        reserve_slots: int = 0,
    ) -> None:
        """`lazy`: the engines start on the first request, not at `start()`
        (`planned_card` stands for theirs until then). `reserve_slots`: each
        worker's engine runs `slots_per_worker` + these; only a key's new flow
        takes one (engine_adapter/admission.py)."""
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if reserve_slots < 0:
            raise ValueError("reserve_slots must be >= 0")
        self.name = name
        self.workers = [
            Worker(index=i, engine=factory(i), slots=slots_per_worker, reserve=reserve_slots)
            for i in range(num_workers)
        ]
        # a restart builds the same kind of engine (read on every request: summed up once)
        self._relays = any(getattr(w.engine, "relays", False) for w in self.workers)
        self._accepting = False
        self.lazy = lazy
        self._planned = planned_card
        self._started = False
        self._starting: asyncio.Future[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # which worker of those with a free slot (routing/policy.py)
        self.policy: RoutingPolicy = RoutingPolicy()
        self.supervisor = Supervisor(
            name, self.workers, factory,
            spawn=self._spawn, accepting=lambda: self._accepting, forget=lambda i: self.policy.forget(i),
            wake=lambda w: self.admission.dispatch(w), readiness_interval=readiness_interval,
            probe_timeout=probe_timeout, restart_backoff=restart_backoff,
        )
        self.runner = Runner(name, on_dead=self.supervisor.on_dead, accepting=lambda: self._accepting,
                             observe=lambda i, tokens, cached: self.policy.observe(i, tokens, cached),
                             settle=lambda i, tokens: self.policy.settle(i, tokens))
        self.admission = Admission(
            name, self.workers, pick=self._pick, accepting=lambda: self._accepting,
            max_queue_size=max_queue_size, max_queue_wait=max_queue_wait, policy=queue_policy,
        )
        self.counters = self.admission.counters
        self.queue = self.admission.queue
        self.queue_stats = self.admission.stats

    # ---- what the HTTP layer reads -------------------------------------
    @property
    def card(self) -> ModelCard:
        if self._planned is not None and self.deferred:
            return self._planned
        return self.workers[0].engine.card

    @property
    def deferred(self) -> bool:
        """A lazy pool whose engines wait for the first request."""
        return self.lazy and not self._started

    @property
    def tokenizer(self) -> Tokenizer:
        return self.workers[0].engine.tokenizer

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def queue_depth_by_priority(self) -> dict[int, int]:
        return {p: n for p, n in self.queue.depth_by_priority().items() if n}

    @property
    def queue_policy(self) -> Policy:
        return self.queue.policy

    def set_queue_policy(self, policy: Policy) -> None:
        """Switch between `fair` and `fifo` at run time (a reload): every
        queued request stays queued."""
        self.queue.set_policy(policy)

    @property
    def capacity(self) -> int:
        """Engine slots of the live workers (without the reserve)."""
        return sum(w.slots for w in self.workers if w.alive)

    @property
    def reserve(self) -> int:
        """Reserve slots of the live workers (--fair-reserve-slots)."""
        return sum(w.reserve for w in self.workers if w.alive)

    @property
    def reserve_running(self) -> int:
        """Reserve slots taken now."""
        return sum(w.reserved for w in self.workers)

    def saturation(self) -> float:
        """Requests running or queued over the slots of live workers: 1.0
        is every slot taken, above 1 a queue builds (for autoscaling)."""
        busy = sum(w.in_flight for w in self.workers) + len(self.queue)
        cap = self.capacity or sum(w.slots for w in self.workers)
        return busy / cap if cap else 0.0

    def estimated_wait(self) -> float | None:
        """Seconds the queued work takes at the measured service rate (None:
        not measured yet)."""
        rate = self.queue_stats.rate.per_second
        return self.queue.queued_cost() / rate if rate else None

    # ---- the owned parts, as the HTTP layer and the tests read them ----
    @property
    def running(self) -> int:
        return self.runner.running

    async def wait_idle(self) -> None:
        await self.runner.wait_idle()

    @property
    def passive_readiness(self) -> bool:
        return self.supervisor.passive_readiness

    @passive_readiness.setter
    def passive_readiness(self, value: bool) -> None:
        self.supervisor.passive_readiness = value

    def alive_workers(self) -> int:
        return self.supervisor.alive_workers()

    def ready_workers(self, now: float | None = None) -> int:
        return self.supervisor.ready_workers(now)

    def _ready_window(self) -> float:
        return self.supervisor.ready_window()

    def _on_dead(self, w: Worker, err: BaseException) -> None:
        self.supervisor.on_dead(w, err)

    def stats(self) -> list[EngineStats]:
        return [w.engine.stats() for w in self.workers]

    def ready(self, now: float | None = None) -> bool:
        """At least one live worker did a real generation recently (passive
        readiness: or produced output). A deferred pool is ready: its first
        request starts the engines."""
        if self.deferred:
            return self._accepting
        return self._accepting and self.ready_workers(now) > 0

    # ---- lifecycle -----------------------------------------------------
    async def start(self) -> None:
        if self.lazy:
            self._accepting = True
            logger.info("%s: its engine starts on first use", self.name)
            return
        await self._start_engines()

    async def _start_engines(self) -> None:
        await asyncio.gather(*(self._start_worker(w) for w in self.workers))
        if not self.lazy:  # a lazy pool accepts from `start()` on (and may be draining by now)
            self._accepting = True
        self._started = True
        for w in self.workers:
            await self.supervisor.probe(w)
            self._spawn(self.supervisor.probe_loop(w))

    async def ensure_started(self) -> None:
        """A deferred pool's engines start (once, whoever asks first; the
        others wait for the same start). A failed start is a 503 to its
        waiters, and the next request tries again."""
        if not self.deferred:
            return
        if not self._accepting:
            self.counters.rejected["shutting_down"] += 1
            raise ShuttingDown("the server is shutting down", retry_after=5)
        if self._starting is None:
            logger.info("%s: first request: starting its engine", self.name)
            t0 = time.monotonic()
            starting = self._starting = asyncio.ensure_future(self._start_engines())

            def done(f: asyncio.Future[None]) -> None:
                if f.cancelled() or f.exception() is not None:
                    err = "cancelled" if f.cancelled() else f.exception()
                    logger.error("%s: its engine failed to start: %s", self.name, err)
                    self._starting = None
                    self._started = False
                    for w in self.workers:  # a worker that did start is stopped: the next start is whole
                        if w.alive:
                            w.alive = False
                            self._spawn(w.engine.stop())
                else:
                    logger.info("%s: engine started on first use in %.1fs", self.name, time.monotonic() - t0)

            starting.add_done_callback(done)
        waiting_for: asyncio.Future[None] = self._starting
        try:
            await asyncio.shield(waiting_for)
        except GatewayError:
            raise
        except Exception as e:
            raise EngineDead(f"model {self.name!r}: its engine failed to start ({e})", retry_after=5) from e

    async def _start_worker(self, w: Worker) -> None:
        await w.engine.start()
        w.alive = True

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self, timeout: float = 0.0) -> None:
        """Stop accepting, drain in-flight work for up to `timeout`, abort the
        rest with clean errors, then stop the engines."""
        self._accepting = False
        if self._starting is not None and not self._starting.done():  # its engine processes must not outlive us
            await asyncio.gather(self._starting, return_exceptions=True)
        self.admission.drain()
        if self.running and timeout > 0:
            try:
                await asyncio.wait_for(self.runner.wait_idle(), timeout)
            except (TimeoutError, asyncio.TimeoutError):
                logger.warning(
                    "%s: %d requests still running after %.1fs; aborting them",
                    self.name, self.running, timeout,
                )
        for w in self.workers:
            for t in list(w.tasks):
                t.cancel()
        await cancel_and_wait(list(self._background))
        await asyncio.gather(*(w.engine.stop() for w in self.workers), return_exceptions=True)
        await self.policy.close()
        for w in self.workers:
            w.alive = False

    def stop_accepting(self) -> None:
        self._accepting = False

    # ---- admission -----------------------------------------------------
    def _pick(self, key: RouteKey | None = None) -> Worker | None:
        """A worker with a free slot, as the policy chooses; with no key
        (least outstanding), the one with the fewest in flight."""
        workers = self.workers
        if key is None or len(workers) == 1:
            best: Worker | None = None
            for w in workers:
                if w.free > 0 and (best is None or w.in_flight < best.in_flight):
                    best = w
            if best is not None and len(workers) > 1:
                self.policy.stats.decisions["least_outstanding"] += 1
            return best
        free = [w for w in workers if w.free > 0]
        if not free:
            return None
        return free[self.policy.choose([w.index for w in free], [w.in_flight for w in free], key)]

    @property
    def relays(self) -> bool:
        """Upstream nodes, reached by pass-through (no local tokenizer)."""
        return self._relays

    async def acquire(
        self, ask: Ask, session: str | None = None, model: str | None = None
    ) -> PoolLease | PoolRelayLease:
        """Admission: an engine slot per request of `ask` (a local lease), or
        one for a pass-through call a node accepted (a relay lease, for
        upstream nodes), or a `GatewayError` kind. `model`: the
        served name the requests carry (a router's target)."""
        if self.lazy and not self._started:
            await self.ensure_started()
        name = model or self.name
        if self.relays:
            return await self._acquire_relay(ask.relay(name), session)
        reqs = ask.local(self, name)
        held: list[tuple[GenerationRequest, Slot]] = []
        keyed = len(self.workers) > 1
        try:
            for r in reqs:
                lora = r.lora.name if r.lora is not None else None
                key = self.policy.key_for_tokens(r.prompt_token_ids, session, lora) if keyed else None
                cost = request_cost(r)
                slot = await self.admission.take(
                    r.priority, r.deadline, key, tenant=r.api_key_name or "", cost=cost, ttft=r.ttft_deadline
                )
                held.append((r, slot))
        except BaseException:
            for got, slot in held:
                if keyed and isinstance(got, GenerationRequest):  # routed, never run
                    self.policy.settle(slot.worker.index, got.prompt_token_ids)
                self._release_slot(slot)
            raise
        return PoolLease(name, held, self.runner.run, self._release_slot)

    async def _acquire_relay(self, call: RelayCall, session: str | None = None) -> PoolRelayLease:
        """A slot, then the node's acceptance of the call (its status line):
        a node that refuses or cannot be reached fails admission. The
        upstream's policy picks the node (`session` for it)."""
        cost = relay_cost(call)
        slot = await self.admission.take(
            call.priority, call.deadline, tenant=call.api_key_name or "", cost=cost, ttft=call.ttft_deadline
        )
        try:
            slot.opened = await slot.worker.engine.open(call, session)  # type: ignore[attr-defined]
        except BaseException:
            self._release_slot(slot)
            raise
        return PoolRelayLease(call, slot, self.runner.relay, self._release_slot)

    def _release_slot(self, slot: Slot) -> None:
        """The lease's way to give a slot back (once; later calls do nothing)."""
        if not slot.released:
            slot.released = True
            if slot.opened is not None:
                slot.opened.close()  # never relayed: the node sees the disconnect
            self.admission.give_back(slot)

    # ---- generation ----------------------------------------------------
    async def generate(
        self, req: GenerationRequest, idle_tick: float | None = None
    ) -> AsyncIterator[EngineOutput | None]:
        """Admit `req`, then its outputs one at a time (None: an idle tick).
        For probes and tests; the HTTP layer acquires and streams itself."""
        lease = await self.acquire(Prepared([req]))
        assert isinstance(lease, PoolLease)  # Prepared is never relayed: upstream nodes refuse it at admission
        async with aclosing(lease.stream(idle_tick)) as stream:
            async for _, batch in stream:
                if batch is None:
                    yield None
                    continue
                for out in batch:
                    yield out

    async def embed(self, req: EmbeddingRequest, session: str | None = None) -> Embedded:
        if self.lazy and not self._started:
            await self.ensure_started()
        slot = await self.admission.take(req.priority, req.deadline, tenant=req.api_key_name or "",
                                         cost=sum(map(len, req.inputs)))
        w = slot.worker
        self.runner.begin()
        try:
            coro = w.engine.embed(req)
            if req.deadline is not None:
                try:
                    vectors = await asyncio.wait_for(coro, max(0.0, req.deadline - time.monotonic()))
                except (TimeoutError, asyncio.TimeoutError):
                    raise RequestTimeout("the embedding request exceeded the request timeout") from None
            else:
                vectors = await coro
            w.saw_output()
            return Embedded(self.name, vectors)
        except EngineDead as e:
            self.supervisor.on_dead(w, e)
            raise
        finally:
            self.runner.end()
            slot.cost = 0  # as before: an embedding does not feed the service rate
            self.admission.give_back(slot)
