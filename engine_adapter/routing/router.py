"""A `Router` serves one alias over several targets (served models, each a
WorkerPool of local or remote engines, so queueing and admission stay the
pools'). It has the surface the HTTP routes use from a pool (`acquire`,
`embed`, `card`, `tokenizer`, `name`, `ready()`, ...).

- Weighted choice; with a session key (X-Session-ID or the request's `user`,
  passed to `acquire`) weighted rendezvous hashing, so a session stays on
  one target and a weight change moves only the sessions it must.
- Fallback at admission: a full queue, a queue timeout or an unavailable
  target moves the request to the next target of the alias's ordered
  fallback list before the response starts, so the lease (and the
  `x-npugw-served-by` header) already names the target that answers.
- Fallback in the stream: an engine failure before the first token moves
  the request on as well. Never after a token was yielded.
- Canary rollback: a target with less than the largest weight whose error
  rate or TTFT p95 over a sliding window is past the policy's threshold gets
  weight 0 (log line, metric) until the routes are set again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from engine_adapter.errors import GatewayError, ServiceUnavailable, fallback_reason, target_failed
from engine_adapter.lease import Ask, Lease, LocalLease, Relayed, RelayLease, Tagged, WrappedLocal, WrappedRelay
from engine_adapter.routing.metrics import RoutingMetrics
from engine_adapter.routing.spec import CanaryPolicy, RouteSpec
from engine_adapter.types import Embedded, EmbeddingRequest, EngineStats, ModelCard, Tokenizer

logger = logging.getLogger(__name__)
L = TypeVar("L", LocalLease, RelayLease)
T = TypeVar("T")


class ServedPool(Protocol):
    """What the HTTP layer uses of a served model: a WorkerPool or a Router."""

    name: str

    @property
    def card(self) -> ModelCard: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def running(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def relays(self) -> bool: ...

    async def ensure_started(self) -> None: ...

    async def acquire(
        self, ask: Ask, session: str | None = None, model: str | None = None
    ) -> Lease: ...

    async def embed(self, req: EmbeddingRequest, session: str | None = None) -> Embedded: ...

    def ready(self, now: float | None = None) -> bool: ...

    def alive_workers(self) -> int: ...

    def ready_workers(self, now: float | None = None) -> int: ...

    def stats(self) -> list[EngineStats]: ...


class _Window:
    __slots__ = ("errors", "samples", "span")

    def __init__(self, span: float) -> None:
        self.span = span
        self.samples: deque[tuple[float, bool, float | None]] = deque()
        self.errors = 0

    def add(self, now: float, failed: bool, ttft: float | None) -> None:
        self.samples.append((now, failed, ttft))
        self.errors += failed
        self.trim(now)

    def trim(self, now: float) -> None:
        while self.samples and now - self.samples[0][0] > self.span:
            self.errors -= self.samples.popleft()[1]

    def error_rate(self) -> float:
        return self.errors / len(self.samples) if self.samples else 0.0

    def ttft_p95(self) -> float | None:
        ttfts = sorted(t for _, _, t in self.samples if t is not None)
        return ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None


@dataclass(slots=True)
class Target:
    name: str
    weight: float  # as configured
    pool: ServedPool
    window: _Window
    rolled_back: str | None = None  # why its weight is 0 now
    last_check: float = 0.0

    @property
    def effective(self) -> float:
        return 0.0 if self.rolled_back else self.weight


def _score(key: str, target: str, weight: float) -> float:
    """Weighted rendezvous hashing: the largest score wins; P(win) ~ weight."""
    h = int.from_bytes(hashlib.blake2b(f"{key}\0{target}".encode(), digest_size=8).digest(), "big")
    return -weight / math.log((h + 0.5) / 2**64)


class Router:
    def __init__(
        self,
        spec: RouteSpec,
        pools: Mapping[str, ServedPool],
        policy: CanaryPolicy,
        metrics: RoutingMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.name = spec.alias
        self.created = int(time.time())
        self.policy = policy
        self.metrics = metrics
        self._pools = pools
        self._rng = rng or random.Random()
        self.configure(spec)

    def configure(self, spec: RouteSpec) -> None:
        """New targets, weights and fallbacks; in-flight requests keep theirs."""
        self.spec = spec
        self.targets = [Target(n, w, self._pools[n], _Window(self.policy.window)) for n, w in spec.targets]
        self.fallbacks = spec.fallbacks
        for t in self.targets:
            self.metrics.weight.labels(self.name, t.name).set(t.effective)

    # ---- the pool surface ----------------------------------------------
    @property
    def primary(self) -> Target:
        return max(self.targets, key=lambda t: t.effective)

    def _all_pools(self) -> list[ServedPool]:
        names = dict.fromkeys([*(t.name for t in self.targets), *self.fallbacks])
        return [self._pools[n] for n in names]

    @property
    def card(self) -> ModelCard:
        card = self.primary.pool.card
        shortest = min(p.card.max_model_len for p in self._all_pools())
        return replace(card, max_model_len=shortest, root=self.name)

    @property
    def tokenizer(self) -> Tokenizer:
        """The primary's, else the first local target's (upstream nodes
        hold theirs)."""
        pools = [self.primary.pool, *self._all_pools()]
        return next((p for p in pools if not p.relays), self.primary.pool).tokenizer

    @property
    def relays(self) -> bool:
        """Every target is upstream nodes: requests are passed through."""
        return all(p.relays for p in self._all_pools())

    async def ensure_started(self) -> None:
        """The engines of targets that start on first use (see WorkerPool)."""
        await asyncio.gather(*(p.ensure_started() for p in self._all_pools()))

    @property
    def running(self) -> int:
        return sum(p.running for p in self._all_pools())

    @property
    def queue_depth(self) -> int:
        return sum(p.queue_depth for p in self._all_pools())

    def stats(self) -> list[EngineStats]:
        return [s for p in self._all_pools() for s in p.stats()]

    def ready(self, now: float | None = None) -> bool:
        return any(p.ready(now) for p in self._all_pools())

    def alive_workers(self) -> int:
        return sum(p.alive_workers() for p in self._all_pools())

    def ready_workers(self, now: float | None = None) -> int:
        return sum(p.ready_workers(now) for p in self._all_pools())

    # ---- choice -------------------------------------------------------------
    def choose(self, session: str | None = None) -> Target:
        live = [t for t in self.targets if t.effective > 0]
        if not live:
            raise ServiceUnavailable(f"alias {self.name!r} has no target with a weight above 0", retry_after=5)
        if len(live) == 1:
            return live[0]
        if session is not None:
            return max(live, key=lambda t: _score(session, t.name, t.effective))
        x = self._rng.random() * sum(t.effective for t in live)
        for t in live:
            x -= t.effective
            if x < 0:
                return t
        return live[-1]

    def chain(self, session: str | None) -> list[tuple[str, ServedPool, Target | None]]:
        """The target to try first (weighted, or by session), then the
        alias's fallbacks in order."""
        first = self.choose(session)
        out: list[tuple[str, ServedPool, Target | None]] = [(first.name, first.pool, first)]
        by_name = {t.name: t for t in self.targets}
        for name in self.fallbacks:
            if all(name != n for n, _, _ in out):
                out.append((name, self._pools[name], by_name.get(name)))
        return out

    # ---- requests -----------------------------------------------------------
    async def acquire(
        self, ask: Ask, session: str | None = None, model: str | None = None
    ) -> RouterLocalLease | RouterRelayLease:
        """Admission on the first target of the chain that has room; the
        lease is of that target's kind (a local engine's, or a relay)."""
        chain = self.chain(session)
        i, inner = await self._admit(chain, 0, ask)
        if isinstance(inner, RelayLease):
            return RouterRelayLease(self, chain, i, inner, ask)
        return RouterLocalLease(self, chain, i, inner, ask)

    async def _admit(
        self, chain: list[tuple[str, ServedPool, Target | None]], start: int, ask: Ask
    ) -> tuple[int, Lease]:
        for i in range(start, len(chain)):
            name, pool, _ = chain[i]
            try:
                return i, await pool.acquire(ask, model=name)
            except GatewayError as e:
                self._failed(chain, i, e, math.inf, ttft=None)
        raise AssertionError("unreachable: the last target raises")

    def _failed(
        self,
        chain: list[tuple[str, ServedPool, Target | None]],
        i: int,
        e: GatewayError,
        deadline: float,
        ttft: float | None,
    ) -> None:
        """Record a failure on target `i`; raise `e` unless the request may
        move to target `i + 1` (only before its first token)."""
        name, _, target = chain[i]
        reason = fallback_reason(e) if ttft is None else None
        can = reason is not None and i + 1 < len(chain) and deadline > time.monotonic()
        self._record(target, name, "fallback" if can else "error", target_failed(e) or None, None)
        if not can:
            raise e
        self._fell_back(name, chain[i + 1][0], reason or "", e)

    async def embed(self, req: EmbeddingRequest, session: str | None = None) -> Embedded:
        chain = self.chain(session)
        deadline = req.deadline if req.deadline is not None else math.inf
        for i, (name, pool, target) in enumerate(chain):
            start = time.monotonic()
            try:
                got = await pool.embed(replace(req, model=name))
            except GatewayError as e:
                self._failed(chain, i, e, deadline, ttft=None)
                continue
            self._record(target, name, "ok", False, time.monotonic() - start)
            return Embedded(name, got.vectors)
        raise AssertionError("unreachable: the last target raises")

    def _fell_back(self, src: str, dst: str, reason: str, e: GatewayError) -> None:
        self.metrics.fallbacks.labels(self.name, src, dst, reason).inc()
        logger.info("alias %s: %s failed before the first token (%s: %s); falling back to %s",
                    self.name, src, reason, e.message, dst)

    def _record(self, target: Target | None, name: str, outcome: str, failed: bool | None, ttft: float | None) -> None:
        self.metrics.requests.labels(self.name, name, outcome).inc()
        if target is None or failed is None:
            return
        now = time.monotonic()
        target.window.add(now, failed, ttft)
        self._check(target, now)

    # ---- canary rollback ------------------------------------------------------
    def _check(self, t: Target, now: float) -> None:
        p = self.policy
        if t.rolled_back or now - t.last_check < p.check_every:
            return
        t.last_check = now
        top = max(o.weight for o in self.targets)
        if t.weight >= top or not any(o is not t and o.effective > 0 for o in self.targets):
            return  # not a canary, or the last target standing
        w = t.window
        w.trim(now)
        n = len(w.samples)
        if n < p.min_requests:
            return
        why = kind = None
        rate, p95 = w.error_rate(), w.ttft_p95()
        if p.max_error_rate is not None and rate > p.max_error_rate:
            why, kind = f"error rate {rate:.0%} > {p.max_error_rate:.0%}", "error_rate"
        elif p.max_ttft_p95 is not None and p95 is not None and p95 > p.max_ttft_p95:
            why, kind = f"TTFT p95 {p95:.3f}s > {p.max_ttft_p95:g}s", "ttft_p95"
        if why is None or kind is None:
            return
        t.rolled_back = f"{why} over the last {n} requests ({p.window:g}s window)"
        self.metrics.weight.labels(self.name, t.name).set(0)
        self.metrics.rollbacks.labels(self.name, t.name, kind).inc()
        logger.warning(
            "alias %s: canary %s rolled back, weight %g -> 0: %s", self.name, t.name, t.weight, t.rolled_back
        )

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        targets = []
        for t in self.targets:
            t.window.trim(now)
            targets.append({
                "model": t.name, "weight": t.weight, "effective_weight": t.effective, "rolled_back": t.rolled_back,
                "window_requests": len(t.window.samples), "error_rate": round(t.window.error_rate(), 4),
                "ttft_p95": t.window.ttft_p95(),
            })
        return {"targets": targets, "fallbacks": list(self.fallbacks)}


@dataclass(slots=True, eq=False, repr=False)
class _Moves(Generic[L]):
    """What both kinds of an alias's lease share: the chain of targets, the
    one that holds the request now (`_i`, its lease `_inner`), and the move
    to the next."""

    _router: Router
    _chain: list[tuple[str, ServedPool, Target | None]]
    _i: int
    _inner: L
    _ask: Ask

    @property
    def served_by(self) -> str:
        return self._chain[self._i][0]

    async def _next(self, e: GatewayError, deadline: float, first: float | None, kind: type[L]) -> L:
        """Target `_i` failed with `e`: record it, then admission on the next
        target that has room (raises `e` unless the request may move on). A
        lease never changes kind: a next target of the other kind is given
        back and `e` stands. (`kind` is an abstract class, which mypy flags
        at the call: python/mypy#4717.)"""
        self._router._failed(self._chain, self._i, e, deadline, first)
        i, inner = await self._router._admit(self._chain, self._i + 1, self._ask)
        if not isinstance(inner, kind):
            inner.release()
            raise e from None
        self._i = i
        return inner

    async def _follow(
        self,
        kind: type[L],
        items: Callable[[L], AsyncGenerator[T, None]],
        first: Callable[[T], bool],
        deadline: Callable[[L], float],
    ) -> AsyncGenerator[T, None]:
        """The `items` of the lease on target `_i`, timed to the `first`
        one (a token, a byte of the node's answer); a failure moves the
        lease on to the next target (`_next`, with the request's `deadline`)
        and its items follow."""
        router = self._router
        while True:
            name, _, target = self._chain[self._i]
            start = time.monotonic()
            ttft: float | None = None
            inner = self._inner
            try:
                async with aclosing(items(inner)) as stream:
                    async for item in stream:
                        if ttft is None and first(item):
                            ttft = time.monotonic() - start
                        yield item
            except GatewayError as e:
                inner.release()
                self._inner = await self._next(e, deadline(inner), ttft, kind)
                continue
            except BaseException:
                inner.release()
                router._record(target, name, "cancelled", None, None)
                raise
            inner.release()
            router._record(target, name, "ok", False, ttft)
            return


class RouterLocalLease(_Moves[LocalLease], WrappedLocal):
    """A lease on one local target of an alias. If that target fails before
    the first token, the lease moves on to the next target of the chain
    that admits the request; the HTTP layer waits for that first output
    before its status line, so `served_by` names the target that answers.
    A stream cannot turn into a relay midway: a next target of upstream
    nodes fails it with the first target's error."""

    __slots__ = ()

    def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        return self._follow(
            LocalLease,  # type: ignore[type-abstract]
            lambda inner: inner.stream(idle_tick),
            lambda item: bool(item[1]),  # a batch of outputs, not an idle tick
            lambda inner: min((r.deadline for r in inner.requests if r.deadline is not None), default=math.inf),
        )


class RouterRelayLease(_Moves[RelayLease], WrappedRelay):
    """A lease on one target of upstream nodes of an alias: as
    RouterLocalLease, it moves on before the node's first byte; a relay
    cannot turn into a local stream midway."""

    __slots__ = ()

    def relay(self) -> AsyncGenerator[Relayed, None]:
        return self._follow(
            RelayLease,  # type: ignore[type-abstract]
            lambda inner: inner.relay(),
            lambda item: isinstance(item, bytes),  # not the usage the node reports
            lambda inner: inner.call.deadline if inner.call.deadline is not None else math.inf,
        )
