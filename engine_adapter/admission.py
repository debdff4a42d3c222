"""Admission to one WorkerPool's slots: a free slot at once, or a wait in
the queue (engine_adapter/scheduler.py) until a slot frees, with every
refusal as a kind: draining, no live worker, queue full, queue timeout, a
time-to-first-token deadline that cannot be met. Owned by the pool and
given what it needs: the workers, `pick` (the routing policy's choice among
workers with a free slot) and `accepting` (whether the pool still serves).

Reserve slots (--fair-reserve-slots N: each worker's engine runs its slots
+ N): ordinary requests see only the slots; a reserve slot goes, with the
`fair` policy, to a request that would otherwise wait and whose key has
nothing running nor queued in this model (a new flow, as in FQ-CoDel) while
nothing more urgent waits, or whose priority value is lower than that of
every running request. So a key that sends one request at a time behind a
flood starts at once instead of after one slot turnover. A reserve slot
freed goes to the queue's next waiter when that one qualifies too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine_adapter.errors import DeadlineUnmeetable, EngineDead, QueueFull, QueueTimeout, ShuttingDown
from engine_adapter.lease import Slot, Worker
from engine_adapter.routing.policy import RouteKey
from engine_adapter.scheduler import FairQueue, Policy, QueueStats, Waiter

logger = logging.getLogger("engine_adapter.pool")
K = TypeVar("K")


@dataclass(slots=True)
class PoolCounters:
    rejected: Counter[str] = field(default_factory=Counter)
    queue_time_total: float = 0.0
    dispatched: int = 0


class Admission:
    def __init__(
        self,
        name: str,
        workers: list[Worker],
        *,
        pick: Callable[[RouteKey | None], Worker | None],
        accepting: Callable[[], bool],
        max_queue_size: int = 1024,
        max_queue_wait: float = 60.0,
        policy: Policy = "fair",
    ) -> None:
        self.name = name
        self.workers = workers
        self._pick = pick
        self._accepting = accepting
        self.max_queue_size = max_queue_size
        self.max_queue_wait = max_queue_wait
        self.queue = FairQueue(policy)
        self.stats = QueueStats()
        self.counters = PoolCounters()
        self._seq = itertools.count()
        self.running_by_tenant: Counter[str] = Counter()
        self.running_by_priority: Counter[int] = Counter()
        self._reserves = any(w.reserve for w in workers)  # --fair-reserve-slots above 0

    def drain(self) -> None:
        """Every queued request is refused (the server shuts down)."""
        for waiter in self.queue.drain():
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDown("the server is shutting down", retry_after=5))

    def refuse(self, tenant: str, reason: str) -> None:
        self.counters.rejected[reason] += 1
        self.stats.refused[(tenant, reason)] += 1

    async def take(
        self,
        priority: int,
        deadline: float | None,
        key: RouteKey | None = None,
        *,
        tenant: str = "",
        cost: int = 1,
        ttft: float | None = None,
    ) -> Slot:
        """A slot taken for this request, at once or after a wait in the
        queue. `deadline`: the request's own (a wait past it is a queue
        timeout); `ttft`: when its first token is due."""
        if not self._accepting():
            self.refuse(tenant, "shutting_down")
            raise ShuttingDown("the server is shutting down", retry_after=5)
        if not self.queue:
            w = self._pick(key)
            if w is not None:
                self.stats.waited(tenant, 0.0)
                return self._grant(w, tenant, priority, cost)
        if self._reserves and (w := self._reserve_worker()) is not None:
            reason = self._reserve_reason(priority, tenant)
            if reason is not None:
                self.stats.waited(tenant, 0.0)
                return self._grant(w, tenant, priority, cost, reason)
        if not any(w.alive for w in self.workers):
            self.refuse(tenant, "no_worker")
            raise EngineDead(
                f"model {self.name!r} has no live worker (restarting)", retry_after=5
            )
        if len(self.queue) >= self.max_queue_size:
            self.refuse(tenant, "queue_full")
            raise QueueFull(
                f"the queue of model {self.name!r} is full "
                f"({self.max_queue_size} waiting); retry later",
                retry_after=1,
            )
        now = time.monotonic()
        estimate = self._estimate(priority, tenant, cost)
        if ttft is not None and (ttft <= now or (estimate is not None and now + estimate > ttft)):
            self.refuse(tenant, "deadline_unmeetable")
            raise DeadlineUnmeetable(
                f"the time-to-first-token deadline cannot be met: about {estimate or 0:.1f}s of queued work "
                f"is ahead of this request at model {self.name!r}, {max(0.0, ttft - now):.1f}s are left",
                retry_after=max(1.0, estimate or 0.0),
            )
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            priority, next(self._seq), loop.create_future(), now, tenant=tenant, cost=cost, key=key,
            ttft_deadline=ttft, estimate=estimate,
        )
        self.queue.push(waiter, running=self.running_by_tenant[tenant] > 0)
        limits = [self.max_queue_wait]
        if deadline is not None:
            limits.append(max(0.0, deadline - now))
        if ttft is not None:
            limits.append(max(0.0, ttft - now))
        wait = min(limits)
        try:
            slot = await asyncio.wait_for(asyncio.shield(waiter.future), wait)
        except (TimeoutError, asyncio.TimeoutError):
            self._forget(waiter)
            if waiter.future.done() and not waiter.future.exception():
                return waiter.future.result()  # assigned at the last moment
            if ttft is not None and wait >= ttft - now:
                self.refuse(tenant, "deadline_expired")
                raise DeadlineUnmeetable(
                    f"the time-to-first-token deadline passed after {wait:.1f}s in the queue of model "
                    f"{self.name!r}; the request was not started",
                    retry_after=1,
                ) from None
            self.refuse(tenant, "queue_timeout")
            raise QueueTimeout(
                f"request waited {wait:.1f}s in the queue of model {self.name!r} "
                "without a free engine slot; it was not started",
                retry_after=1,
            ) from None
        except asyncio.CancelledError:
            self._forget(waiter)
            if waiter.future.done() and not waiter.future.cancelled() and not waiter.future.exception():
                self.give_back(waiter.future.result())
            raise
        return slot

    def _estimate(self, priority: int, tenant: str, cost: int) -> float | None:
        """Seconds until a new request would leave the queue: the work ahead
        of it at its fair position over the measured service rate."""
        rate = self.stats.rate.per_second
        if rate is None:
            return None
        return self.queue.work_ahead(priority, tenant, cost) / rate

    def _forget(self, waiter: Waiter) -> None:
        """A waiter that leaves before it got a slot (client gone, timed out)."""
        if not waiter.cancelled:
            waiter.cancelled = True
            self.queue.remove(waiter)

    def give_back(self, slot: Slot) -> None:
        """A slot is free again (after work of `slot.cost`): it goes to the
        next waiter. The lease's to call (once per slot)."""
        w = slot.worker
        busy = bool(self.queue) or all(x.free == 0 for x in self.workers if x.alive)
        self.stats.rate.served(time.monotonic(), slot.cost, busy)
        w.in_flight -= 1
        if slot.reserve:
            w.reserved -= 1
        _less(self.running_by_tenant, slot.tenant)
        _less(self.running_by_priority, slot.priority)
        self.dispatch(w)

    def dispatch(self, w: Worker) -> None:
        """Hand free slots to the next waiters (`w` just freed one, or was
        restarted), then free reserve slots to the next waiter while it
        qualifies for one."""
        while self.queue and w.free > 0:
            waiter = self.queue.pop()
            if waiter is None:
                break
            if waiter.cancelled or waiter.future.done():
                continue
            self._start(waiter, self._pick(waiter.key) or w)
        while self._reserves and self.queue and (r := self._reserve_worker()) is not None:
            head = self.queue.peek()
            if head is None:
                break
            if head.cancelled or head.future.done():
                self.queue.pop()
                continue
            reason = self._reserve_reason(head.priority, head.tenant, queued=1)
            if reason is None:
                break
            popped = self.queue.pop()
            assert popped is head  # peek() is pop() on a copy of the same state
            self._start(head, r, reason)

    # ---- inside ------------------------------------------------------------
    def _grant(self, w: Worker, tenant: str, priority: int, cost: int, reserve: str | None = None) -> Slot:
        """Take a slot of `w` (a reserve slot, for `reserve`'s reason)."""
        w.in_flight += 1
        if reserve is not None:
            w.reserved += 1
            self.stats.reserve_admitted[reserve] += 1
        self.running_by_tenant[tenant] += 1
        self.running_by_priority[priority] += 1
        self.counters.dispatched += 1
        return Slot(w, cost=cost, tenant=tenant, priority=priority, reserve=reserve is not None)

    def _start(self, waiter: Waiter, w: Worker, reserve: str | None = None) -> None:
        """A queued waiter gets its slot on `w`."""
        slot = self._grant(w, waiter.tenant, waiter.priority, waiter.cost, reserve)
        waited = time.monotonic() - waiter.enqueued
        self.counters.queue_time_total += waited
        self.stats.waited(waiter.tenant, waited)
        if waiter.estimate is not None:
            self.stats.estimated(waiter.estimate, waited)
            logger.debug("%s: %s waited %.3fs, estimated %.3fs", self.name, waiter.tenant or "-",
                         waited, waiter.estimate)
        waiter.future.set_result(slot)

    def _reserve_worker(self) -> Worker | None:
        """The worker with a free reserve slot and the fewest requests (the
        routing policy's choice is for ordinary slots)."""
        best: Worker | None = None
        for w in self.workers:
            if w.reserve_free > 0 and (best is None or w.in_flight < best.in_flight):
                best = w
        return best

    def _reserve_reason(self, priority: int, tenant: str, queued: int = 0) -> str | None:
        """Why a request that would wait may take a reserve slot, or None:
        `new_flow` (its key has nothing running and nothing queued (but
        itself: `queued`), and nothing more urgent waits), `priority` (a
        lower priority value than every running request). `fifo` never."""
        if self.queue.policy != "fair":
            return None
        if not self.running_by_tenant[tenant] and self.queue.queued(tenant) <= queued:
            best = self.queue.best_priority()
            if best is None or priority <= best:
                return "new_flow"
        if self.running_by_priority and priority < min(self.running_by_priority):
            return "priority"
        return None


def _less(counter: Counter[K], key: K) -> None:
    """One fewer of `key`; gone at zero."""
    left = counter[key] - 1
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)

