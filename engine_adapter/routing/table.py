"""The routing table: every alias's Router, checked and changed as a whole
(settings at start-up, `POST /admin/routes`, SIGHUP). Routers are updated in
place, so requests in flight keep the target they started on."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

from engine_adapter.errors import GatewayError, InvalidRequest
from engine_adapter.routing.metrics import RoutingMetrics
from engine_adapter.routing.router import Router, ServedPool
from engine_adapter.routing.spec import CanaryPolicy, RouteSpec


class RoutingTable:
    def __init__(
        self,
        pools: Mapping[str, ServedPool],
        *,
        policy: CanaryPolicy | None = None,
        metrics: RoutingMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`pools`: every served name of a real model (not an alias) -> its pool."""
        self.pools = dict(pools)
        self.policy = policy or CanaryPolicy()
        self.metrics = metrics or RoutingMetrics()
        self._rng = rng
        self.routers: dict[str, Router] = {}

    def check(self, spec: RouteSpec) -> None:
        """Raise InvalidRequest unless `spec` can be served."""
        alias = spec.alias
        if alias in self.pools and [n for n, _ in spec.targets] != [alias]:
            raise InvalidRequest(f"alias {alias!r} would hide the served model of that name", param="aliases")
        names = [n for n, _ in spec.targets] + list(spec.fallbacks)
        for name in names:
            if name not in self.pools:
                what = "an alias (aliases cannot point to aliases)" if name in self.routers else "not a served model"
                raise InvalidRequest(f"alias {alias!r}: target {name!r} is {what}", param="aliases")
        if not any(w > 0 for _, w in spec.targets):
            raise InvalidRequest(f"alias {alias!r}: at least one target needs a weight above 0", param="aliases")
        kinds = set()
        for n in names:
            try:
                kinds.add(self.pools[n].card.kind)
            except GatewayError:  # a worker restarting has no card now
                continue
        if len(kinds) > 1:
            raise InvalidRequest(f"alias {alias!r} mixes generation and embedding models", param="aliases")

    def apply(
        self, specs: Mapping[str, RouteSpec], *, replace_all: bool = False, remove: Iterable[str] = ()
    ) -> None:
        """Add or change the aliases in `specs`, drop those in `remove` (and,
        with `replace_all`, every alias not in `specs`). All or nothing."""
        remove = set(remove)
        for spec in specs.values():
            self.check(spec)
        for name in remove:
            if name not in self.routers:
                raise InvalidRequest(f"no alias {name!r} to remove", param="remove")
        gone = remove | (set(self.routers) - set(specs) if replace_all else set())
        for name in gone:
            del self.routers[name]
        for name, spec in specs.items():
            router = self.routers.get(name)
            if router is None:
                self.routers[name] = Router(spec, self.pools, self.policy, self.metrics, self._rng)
            else:
                router.configure(spec)
        self.metrics.weight.clear()
        for r in self.routers.values():
            for t in r.targets:
                r.metrics.weight.labels(r.name, t.name).set(t.effective)

    def describe(self) -> dict[str, Any]:
        return {name: r.describe() for name, r in self.routers.items()}
