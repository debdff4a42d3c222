"""What the routes share: the served models and their pools, settings,
metrics. Lives in the app's lifespan state, never in module globals; a
route takes it as `GatewayDep`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from engine_adapter.errors import InvalidRequest, ModelNotFound
from engine_adapter.pool import WorkerPool
from engine_adapter.routing import Router, RoutingTable, ServedPool
from server.settings import Settings

if TYPE_CHECKING:
    from engine_adapter.lora_manager import LoraManager
    from server.limits import Limits


@dataclass(slots=True)
class ServedModel:
    id: str
    pool: ServedPool  # a WorkerPool, or a Router for aliases and names with fallbacks
    root: str
    parent: str | None = None  # set for aliases: the model id they point to
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return self.pool.card.kind

    @property
    def routed(self) -> bool:
        """An alias or a name with fallbacks: a router picks the target."""
        return isinstance(self.pool, Router)


class Gateway:
    def __init__(self, settings: Settings, pools: list[tuple[WorkerPool, tuple[str, ...], str]]) -> None:
        """`pools`: (pool, served names, root path) per model."""
        self.settings = settings
        self.pools = [p for p, _, _ in pools]
        self.models: dict[str, ServedModel] = {}
        for pool, names, root in pools:  # names: none for a pool whose models are discovered (server/discovery.py)
            primary = names[0] if names else ""
            for i, name in enumerate(names):
                self.models[name] = ServedModel(
                    id=name, pool=pool, root=root, parent=None if i == 0 else primary
                )
        self.base_models = dict(self.models)  # the real models, without routing
        self.relays = self._any_relays()
        self.routing: RoutingTable | None = None
        self.draining = False
        self.started_at = time.time()
        self.limits: Limits
        self.lora: LoraManager | None = None  # LoRA adapters (server/routes/lora.py)

    def served_pools(self) -> dict[str, ServedPool]:
        """Served name -> pool of every real model and LoRA adapter (the
        targets aliases may use)."""
        return {name: m.pool for name, m in self.base_models.items() if not isinstance(m.pool, Router)}

    def serves(self, name: str) -> bool:
        """Whether `name` is served already (a model, an adapter, an alias)."""
        return name in self.models or (self.routing is not None and name in self.routing.routers)

    def add_served(self, name: str, pool: ServedPool, root: str, parent: str | None) -> None:
        """A new served name at run time (a LoRA adapter): listed, routable,
        a possible alias target."""
        self.base_models[name] = ServedModel(id=name, pool=pool, root=root, parent=parent)
        if self.routing is not None:
            self.routing.pools[name] = pool
        self.sync_routes()

    def remove_served(self, name: str) -> None:
        self.base_models.pop(name, None)
        if self.routing is not None:
            self.routing.pools.pop(name, None)
        self.sync_routes()

    def routes_using(self, name: str) -> list[str]:
        """The aliases whose targets or fallbacks name `name`."""
        routers = self.routing.routers if self.routing is not None else {}
        return [a for a, r in routers.items()
                if a != name and (name in r.fallbacks or any(t.name == name for t in r.targets))]

    def install_routing(self, table: RoutingTable) -> None:
        self.routing = table
        self.sync_routes()

    def sync_routes(self) -> None:
        """Serve each alias of the routing table through its Router (after
        the table changed). One dict swap: requests in flight are unaffected."""
        models = dict(self.base_models)
        for name, router in (self.routing.routers if self.routing else {}).items():
            base = self.base_models.get(name)
            primary = router.primary.name
            models[name] = ServedModel(
                id=name,
                pool=router,
                root=self.base_models[primary].root,
                parent=primary if primary != name else (base.parent if base else None),
                created=base.created if base else router.created,
            )
        self.models = models
        self.relays = self._any_relays()

    def _any_relays(self) -> bool:
        """Whether some served name is passed through to upstream nodes (the
        short path of server/fast_relay.py looks at requests only then)."""
        return any(m.pool.relays for m in self.models.values())

    async def wait_idle(self, timeout: float) -> None:
        """Until no request runs in any pool, or `timeout` seconds."""
        import asyncio

        waits = [asyncio.ensure_future(p.wait_idle()) for p in self.pools]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for t in pending:
                t.cancel()

    def begin_drain(self) -> None:
        """SIGTERM: /ready fails at once; new requests get 503 + Retry-After."""
        self.draining = True
        for p in self.pools:
            p.stop_accepting()

    def resolve(self, name: str | None, kind: str = "generate") -> ServedModel:
        if not name:
            candidates = [m for m in self.models.values() if m.kind == kind and m.parent is None]
            if len(candidates) == 1:
                return candidates[0]
            raise InvalidRequest("missing required parameter: model", param="model")
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        if model.kind != kind and not model.pool.relays:  # upstream nodes answer for their own model
            what = "an embedding" if model.kind == "embed" else "a generation"
            raise InvalidRequest(
                f"The model `{name}` is {what} model and does not support this endpoint.", param="model"
            )
        return model


async def get_gateway(request: Request) -> Gateway:
    # async: a plain def would cost a worker-thread hop on every request
    gw: Gateway = request.app.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
