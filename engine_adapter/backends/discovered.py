"""A model an upstream's nodes list, served under its own id (`--upstream
URL[,URL...]`, or `;model=*`): a view of the upstream's one pool (its queue,
slots, URLs, breakers and health checks are shared by all its models) that
names the model on the node, so only the URLs that list it take the call
(engine_adapter/routing/upstream.py `Upstream.pick`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from engine_adapter.errors import InvalidRequest
from engine_adapter.lease import Ask, Lease
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import Upstream
from engine_adapter.types import (
    Embedded,
    EmbeddingRequest,
    EngineStats,
    GenerationRequest,
    ModelCard,
    RelayCall,
    Tokenizer,
)

__all__ = ["DiscoveredModel"]


class _NodeAsk:
    """A route's Ask, passed through under the model's id on the node."""

    __slots__ = ("_inner", "_node_id")

    def __init__(self, inner: Ask, node_id: str) -> None:
        self._inner = inner
        self._node_id = node_id

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        raise InvalidRequest(f"model {self._node_id!r} is passed through to its nodes")

    def relay(self, model: str) -> RelayCall:
        return replace(self._inner.relay(model), node_model=self._node_id)


class DiscoveredModel:
    """The served surface (engine_adapter/routing/router.py `ServedPool`) of
    one discovered model."""

    def __init__(self, name: str, base: WorkerPool, upstream: Upstream) -> None:
        self.name = name
        self.base = base
        self.upstream = upstream
        self.created = int(time.time())

    @property
    def card(self) -> ModelCard:
        max_len, kind = self.upstream.card_of(self.name)
        return ModelCard(max_model_len=max_len, kind=kind, root=self.name)  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.base.tokenizer

    @property
    def relays(self) -> bool:
        return True

    @property
    def running(self) -> int:
        return self.base.running

    @property
    def queue_depth(self) -> int:
        return self.base.queue_depth

    async def ensure_started(self) -> None:
        await self.base.ensure_started()

    def stats(self) -> list[EngineStats]:
        return self.base.stats()

    def _usable(self) -> bool:
        up, now = self.upstream, time.monotonic()
        return any(ep.usable(now, up.cfg.cooldown) and up.lists(ep, self.name) for ep in up.endpoints)

    def ready(self, now: float | None = None) -> bool:
        return self._usable() and self.base.ready(now)

    def alive_workers(self) -> int:
        return self.base.alive_workers()

    def ready_workers(self, now: float | None = None) -> int:
        return self.base.ready_workers(now) if self._usable() else 0

    async def embed(self, req: EmbeddingRequest, session: str | None = None) -> Embedded:
        raise InvalidRequest("embeddings of a remote model are passed through, not computed here")

    async def acquire(
        self, ask: Ask, session: str | None = None, model: str | None = None
    ) -> Lease:
        return await self.base.acquire(_NodeAsk(ask, self.name), session, model=model or self.name)
