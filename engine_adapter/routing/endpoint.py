"""One URL of an upstream: its breaker, health and what its node lists
(engine_adapter/routing/upstream.py drives them)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from engine_adapter.routing.node_models import Card

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(slots=True)
class Endpoint:
    url: str
    outstanding: int = 0
    state: BreakerState = "closed"
    failures: int = 0  # request failures in a row
    opened_at: float = 0.0
    trial: bool = False  # a half-open trial request is in flight
    healthy: bool = True  # the active health checks' verdict
    model_id: str | None = None  # the node's model id, from its /v1/models
    embed_id: str | None = None  # its embedding model, when /v1/embeddings goes to another one
    serves: tuple[str, ...] = ()  # every model id the node listed
    models: dict[str, Card] = field(default_factory=dict)  # discovery: the models it listed last, by id
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters (parent: its model): id -> root
    apis: frozenset[str] | None = None  # the client APIs its /openapi.json shows (None: not read yet)
    ejected: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    check_failures: int = 0
    ejections: int = 0
    last_error: str | None = None
    last_seen: float = field(default_factory=time.monotonic)  # the last byte from it
    waiting: int = 0  # non-streamed calls waiting for their answer
    watch_from: float = 0.0  # when the waiting began (silence counts from it or the last byte)
    pinging: bool = False
    slots: int = 0  # the requests it runs at once, from its /v1/models card (0: it does not say)

    def state_at(self, now: float, cooldown: float) -> BreakerState:
        if self.state == "open" and now - self.opened_at >= cooldown:
            return "half_open"
        return self.state

    def usable(self, now: float, cooldown: float) -> bool:
        state = self.state_at(now, cooldown)
        return self.healthy and (state == "closed" or (state == "half_open" and not self.trial))


def eject(ep: Endpoint, code: str = "upstream_ejected") -> None:
    """Fail the requests waiting on `ep` for their first byte."""
    if not ep.ejected.done():
        ep.ejected.set_result(code)


def rearm(ep: Endpoint) -> None:
    """`ep` takes requests again (health checks pass, or its breaker lets a
    trial through): a new ejection will fail the ones waiting on it then."""
    if ep.ejected.done():
        ep.ejected = asyncio.get_running_loop().create_future()
