"""The queue of one WorkerPool: priority bands, fair share between keys
inside a band, and the estimate of a new request's wait.

Lower `priority` values leave first, as in vLLM. Inside one priority value
the `fair` policy keeps one sub-queue per tenant (the API key name; requests
without a key are one tenant, "") and serves them by weighted deficit round
robin (DRR, Shreedhar and Varghese) on each request's estimated cost (prompt
tokens + max_tokens): each visit gives a tenant `quantum x weight` of credit,
and it sends requests while its credit covers their cost, in arrival order.
A tenant whose sub-queue empties loses its credit, so an idle key saves no
credit for later. A key with nothing queued nor running is new: it goes
ahead of the keys that keep a queue, and its first turn covers its first
request (DRR++, as FQ-CoDel treats new flows), so a key that sends one
request at a time waits one slot turnover behind a flood, not a round.
Every tenant with queued work gets credit every round, so
a key with weight 1 among keys with weight 100 still progresses (starvation
cannot happen). `fifo` puts everyone in one sub-queue: priority, then
arrival, the old order.

The queue does not time anything: the pool (engine_adapter/pool.py) owns the
waiters' futures and deadlines. What it measures is kept in `QueueStats`
(at the end of this module): the wait per tenant, refusals per tenant and
reason, the service rate the wait estimate divides by, and how far off that
estimate was. Plain counters read at scrape time (server/queueing.py exports
them); the request path only adds to them.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine_adapter.types import GenerationRequest, RelayCall

if TYPE_CHECKING:
    from engine_adapter.lease import Slot

Policy = Literal["fair", "fifo"]
POLICIES: tuple[Policy, ...] = ("fair", "fifo")
# Credit per DRR round at weight 1, in cost units (tokens). Small: a key gets
# one request per turn, not a quantum's worth (a flood of short requests
# would otherwise leave several at a time); rounds in which nobody's credit
# covers its next request are skipped in one step, so a small quantum costs
# no loop iterations.
QUANTUM = 1


def request_cost(req: GenerationRequest) -> int:
    """The queue's cost of a request: prompt tokens + max_tokens x n."""
    return len(req.prompt_token_ids) + req.sampling.max_tokens * req.sampling.n


def relay_cost(call: RelayCall) -> int:
    """A pass-through call's cost, without a tokenizer: max_tokens (or 256)
    plus a token per four characters of its messages or prompt."""
    body = call.body
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    text = body.get("messages") or body.get("prompt") or body.get("input") or ""
    return (limit if isinstance(limit, int) else 256) + len(str(text)) // 4


@dataclass(eq=False, slots=True)
class Waiter:
    """A request waiting for an engine slot; the pool resolves `future` with
    the slot it was given."""

    priority: int
    seq: int
    future: asyncio.Future[Slot]
    enqueued: float = 0.0
    tenant: str = ""  # the API key name; "" for requests without a key
    cost: int = 1  # estimated work: prompt tokens + max_tokens
    key: Any = None  # its routing key (routing/policy.py RouteKey)
    ttft_deadline: float | None = None  # monotonic time its first token is due
    estimate: float | None = None  # the wait estimated at arrival (s); None: no estimate
    cancelled: bool = False


@dataclass(slots=True)
class _Band:
    """One priority value: a sub-queue per tenant and the DRR state. Tenants
    with work are in `new` (queued since their sub-queue was last empty, not
    yet had a turn) or `old`; `new` is served first."""

    queues: dict[str, deque[Waiter]] = field(default_factory=dict)
    new: deque[str] = field(default_factory=deque)
    old: deque[str] = field(default_factory=deque)
    deficit: dict[str, float] = field(default_factory=dict)
    turn: str | None = None  # the tenant that got its credit for the current visit

    def copy(self) -> _Band:
        return _Band({t: deque(q) for t, q in self.queues.items()}, deque(self.new), deque(self.old),
                     dict(self.deficit), self.turn)

    @property
    def empty(self) -> bool:
        return not self.queues


class FairQueue:
    def __init__(self, policy: Policy = "fair", quantum: float = QUANTUM) -> None:
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy: Policy = policy
        self.quantum = quantum
        self.weights: Mapping[str, float] = {}  # tenant -> weight (default 1)
        self._bands: dict[int, _Band] = {}
        self._len = 0

    # ---- what the pool and the metrics read ---------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def weight(self, tenant: str) -> float:
        return float(self.weights.get(tenant, 1.0))

    def waiters(self) -> Iterator[Waiter]:
        """Every queued waiter, in no particular order."""
        for band in self._bands.values():
            for q in band.queues.values():
                yield from q

    def depth_by_priority(self) -> dict[int, int]:
        return {p: sum(len(q) for q in b.queues.values()) for p, b in self._bands.items()}

    def depth_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.waiters():
            out[w.tenant] = out.get(w.tenant, 0) + 1
        return out

    def queued_cost(self) -> int:
        return sum(w.cost for w in self.waiters())

    def queued(self, tenant: str) -> int:
        """Requests of `tenant` waiting (all of them, with `fifo`)."""
        sub = self._sub(tenant)
        return sum(len(q) for b in self._bands.values() if (q := b.queues.get(sub)) is not None)

    def best_priority(self) -> int | None:
        """The most urgent (lowest) priority value waiting; None when empty."""
        return min(self._bands) if self._bands else None

    def peek(self) -> Waiter | None:
        """The waiter `pop()` would return now (the queue does not change)."""
        if not self._len:
            return None
        return self._pop_band(self._bands[min(self._bands)].copy())

    # ---- changes -------------------------------------------------------
    def push(self, w: Waiter, running: bool = False) -> None:
        """Queue `w`; `running`: its tenant has requests running already (a
        tenant new to the band goes ahead of the others only when not)."""
        band = self._bands.get(w.priority)
        if band is None:
            band = self._bands[w.priority] = _Band()
        sub = self._sub(w.tenant)
        q = band.queues.get(sub)
        if q is None:
            q = band.queues[sub] = deque()
            # a key with nothing queued nor running goes ahead of the keys
            # that keep a queue (DRR++, as FQ-CoDel's new flows): a key
            # sending one request at a time waits one slot turnover, not a round
            (band.old if running else band.new).append(sub)
            band.deficit[sub] = 0.0
        q.append(w)
        self._len += 1

    def pop(self) -> Waiter | None:
        """The next waiter to serve (lowest priority value first, then the
        fair order inside it), removed; None when the queue is empty."""
        if not self._len:
            return None
        prio = min(self._bands)
        band = self._bands[prio]
        w = self._pop_band(band)
        if band.empty:
            del self._bands[prio]
        self._len -= 1
        return w

    def remove(self, w: Waiter) -> bool:
        """Take out a waiter that leaves (its client went, its deadline
        passed); False when it was not queued."""
        band = self._bands.get(w.priority)
        sub = self._sub(w.tenant)
        q = band.queues.get(sub) if band is not None else None
        if band is None or q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        self._len -= 1
        if not q:
            self._drop(band, sub)
            if band.empty:
                del self._bands[w.priority]
        return True

    def drain(self) -> list[Waiter]:
        """Every waiter, in arrival order; the queue is empty afterwards."""
        out = sorted(self.waiters(), key=lambda w: w.seq)
        self._bands.clear()
        self._len = 0
        return out

    def set_policy(self, policy: Policy) -> None:
        """Switch policy; every queued waiter stays, re-queued in arrival
        order under the new one."""
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if policy == self.policy:
            return
        waiting = self.drain()
        self.policy = policy
        for w in waiting:
            self.push(w)

    # ---- looking ahead ---------------------------------------------------
    def upcoming(self, n: int) -> list[Waiter]:
        """The next `n` waiters in the order they would leave now (the queue
        itself does not change)."""
        shadow = FairQueue(self.policy, self.quantum)
        shadow.weights = self.weights
        shadow._bands = {p: b.copy() for p, b in self._bands.items()}
        shadow._len = self._len
        out: list[Waiter] = []
        while len(out) < n:
            w = shadow.pop()
            if w is None:
                break
            out.append(w)
        return out

    def work_ahead(self, priority: int, tenant: str, cost: int) -> float:
        """Cost units that leave before a new request (`priority`, `tenant`,
        `cost`) would: all of the more urgent bands, and in its own band its
        tenant's queued work plus, of each other tenant, the share DRR gives
        it meanwhile (its weight over ours, times our work), at most what it
        has queued."""
        ahead = 0.0
        sub = self._sub(tenant)
        for prio, band in self._bands.items():
            if prio < priority:
                ahead += sum(w.cost for q in band.queues.values() for w in q)
            elif prio == priority:
                mine = sum(w.cost for w in band.queues.get(sub, ()))
                ahead += mine
                share = (mine + cost) / self.weight(sub)
                for t, q in band.queues.items():
                    if t != sub:
                        ahead += min(sum(w.cost for w in q), share * self.weight(t))
        return ahead

    # ---- inside ------------------------------------------------------------
    def _sub(self, tenant: str) -> str:
        return tenant if self.policy == "fair" else ""

    def _drop(self, band: _Band, sub: str) -> None:
        del band.queues[sub]
        del band.deficit[sub]
        if band.turn == sub:
            band.turn = None
        (band.new if sub in band.new else band.old).remove(sub)

    def _pop_band(self, band: _Band) -> Waiter:
        misses = 0
        while True:
            ring = band.new if band.new else band.old
            t = ring[0]
            q = band.queues[t]
            head = q[0]
            if band.turn != t:
                band.deficit[t] += self.quantum * self.weight(t)
                if ring is band.new:  # a new key's first turn covers its first request
                    band.deficit[t] = max(band.deficit[t], head.cost)
                band.turn = t
            if band.deficit[t] >= head.cost:
                band.deficit[t] -= head.cost
                q.popleft()
                if not q:
                    self._drop(band, t)
                return head
            ring.popleft()  # its turn is over: to the end of the round
            band.old.append(t)
            band.turn = None
            misses += 1
            if not band.new and misses >= len(band.old):
                # a whole round and nobody's credit covers its next request:
                # give every tenant the rounds the nearest one still needs
                # but one (it gets that one when the scan reaches it)
                rounds = min(
                    math.ceil((band.queues[s][0].cost - band.deficit[s]) / (self.quantum * self.weight(s)))
                    for s in band.old
                )
                if rounds > 1:
                    for s in band.old:
                        band.deficit[s] += (rounds - 1) * self.quantum * self.weight(s)
                misses = 0


# What the queue measures (see the module's doc).

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class Histogram:
    """Counts per upper bound (not cumulative), a sum and a count."""

    bounds: tuple[float, ...] = WAIT_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last one: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, count at or below it)."""
        out, running = [], 0
        for bound, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


class ServiceRate:
    """Work served per second while the pool is saturated (every slot taken
    or a queue waiting), in the queue's cost units. Only busy stretches
    count, so idle time does not lower it; older stretches fade (each new
    one weighs `1 - decay`)."""

    def __init__(self, decay: float = 0.95, min_samples: int = 4) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self._cost = 0.0
        self._time = 0.0
        self._samples = 0
        self._last: float | None = None

    def served(self, now: float, cost: float, busy: bool) -> None:
        """A slot was released at `now` after work of `cost`; `busy`: the
        pool was saturated just before."""
        if busy and self._last is not None and now > self._last:
            self._cost = self._cost * self.decay + cost
            self._time = self._time * self.decay + (now - self._last)
            self._samples += 1
        self._last = now if busy else None

    @property
    def per_second(self) -> float | None:
        """Cost units per second; None until measured."""
        if self._samples < self.min_samples or self._time <= 0:
            return None
        return self._cost / self._time


@dataclass(slots=True)
class QueueStats:
    wait: dict[str, Histogram] = field(default_factory=dict)  # tenant -> queue wait (s)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, reason)
    estimate_error: Histogram = field(default_factory=Histogram)  # |actual - estimated| wait (s)
    estimate_bias: float = 0.0  # sum of (actual - estimated): > 0, the estimate is low
    rate: ServiceRate = field(default_factory=ServiceRate)
    # requests admitted into a reserve slot (--fair-reserve-slots), by reason:
    # new_flow, priority (engine_adapter/admission.py)
    reserve_admitted: Counter[str] = field(default_factory=Counter)

    def waited(self, tenant: str, seconds: float) -> None:
        h = self.wait.get(tenant)
        if h is None:
            h = self.wait[tenant] = Histogram()
        h.observe(seconds)

    def estimated(self, estimate: float, actual: float) -> None:
        self.estimate_error.observe(abs(actual - estimate))
        self.estimate_bias += actual - estimate
