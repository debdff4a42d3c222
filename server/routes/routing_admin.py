"""Routing at run time: `GET/POST /admin/routes` (aliases, canary weights,
fallbacks) and the SIGHUP reload of the settings file. The per-request glue
(session key in, `x-npugw-served-by` out) is in server/middleware.py.

`setup_routing(app, registry)` wires it into `create_app`;
`start_routing(app, gw)` builds the table in the lifespan, once the pools
run; `stop_routing(app)` undoes it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from engine_adapter.errors import GatewayError, InvalidRequest
from engine_adapter.routing import (
    RouteSpec,
    RoutingMetrics,
    RoutingTable,
    UpstreamCollector,
    parse_alias,
)
from engine_adapter.routing.policies import PolicyCollector, policies_of
from engine_adapter.routing.spec import check_targets
from engine_adapter.routing.upstream import upstreams_of
from server.auth import Principal, require_admin
from server.routes.docs import ERRORS
from server.settings import Settings
from server.state import Gateway, GatewayDep

logger = logging.getLogger(__name__)

router = APIRouter(tags=["admin"])
AdminDep = Annotated[Principal, Depends(require_admin)]


class RoutesUpdate(BaseModel):
    """Aliases given here are added or changed (a fallback list given alone
    keeps the alias's targets; targets given alone keep its fallbacks)."""

    model_config = ConfigDict(extra="forbid")
    aliases: dict[str, dict[str, float] | str] = Field(
        default_factory=dict, description='{"chat-prod": {"qwen-v2": 90, "qwen-v3": 10}} or "qwen-v2:90,qwen-v3:10"'
    )
    fallbacks: dict[str, list[str]] = Field(default_factory=dict, description='{"chat-prod": ["qwen-small"]}')
    remove: list[str] = Field(default_factory=list, description="aliases to drop")
    replace: bool = Field(False, description="drop every alias not given here")


def _table(gw: Gateway) -> RoutingTable:
    if gw.routing is None:
        raise InvalidRequest("routing is not set up on this server")
    return gw.routing


def describe(gw: Gateway) -> dict[str, Any]:
    upstreams = [{"upstream": u.cfg.name, "urls": u.describe()} for u in upstreams_of(gw.pools)]
    return {"object": "routes", "aliases": _table(gw).describe(), "upstreams": upstreams}


@router.get("/admin/routes", responses=ERRORS)
async def get_routes(gw: GatewayDep, admin: AdminDep) -> dict[str, Any]:
    return describe(gw)


@router.post("/admin/routes", responses=ERRORS)
async def set_routes(body: RoutesUpdate, gw: GatewayDep, admin: AdminDep) -> dict[str, Any]:
    table = _table(gw)
    specs: dict[str, RouteSpec] = {}
    try:
        for alias, targets in body.aliases.items():
            pairs = parse_alias(f"{alias}={targets}")[1] if isinstance(targets, str) else check_targets(
                alias, targets.items()
            )
            current = table.routers.get(alias)
            specs[alias] = RouteSpec(alias, pairs, current.fallbacks if current else ())
        for alias, chain in body.fallbacks.items():
            base = specs.get(alias) or (table.routers[alias].spec if alias in table.routers else None)
            specs[alias] = replace(base or RouteSpec(alias, ((alias, 1.0),)), fallbacks=tuple(chain))
    except ValueError as e:
        raise InvalidRequest(str(e), param="aliases") from None
    table.apply(specs, replace_all=body.replace, remove=body.remove)
    gw.sync_routes()
    logger.info("routes changed by %s: %s", admin.name or "open server", {a: s.targets for a, s in specs.items()})
    return describe(gw)


def reload_routes(gw: Gateway) -> bool:
    """SIGHUP: aliases and fallbacks from the settings file (and environment)
    replace the current table. A bad file leaves the routes as they are."""
    if gw.routing is None:
        return False
    if gw.settings.config is None:
        logger.warning("SIGHUP: no settings file (--config) to reload routes from")
        return False
    from server.queueing import reload_queue_policy

    try:
        given: dict[str, Any] = {"config": gw.settings.config}
        fresh = Settings(**given)  # the file and the environment, validated
        gw.routing.apply(fresh.parsed.routes, replace_all=True)
        reload_queue_policy(gw.pools, fresh)  # server/queueing.py: queued requests stay
        if fresh.upstream and fresh.upstream != gw.settings.upstream:
            logger.warning("SIGHUP: upstreams changed in %s; that needs a restart", gw.settings.config)
    except (ValueError, OSError, GatewayError) as e:
        logger.error("SIGHUP: routes in %s rejected, keeping the current ones: %s", gw.settings.config, e)
        return False
    gw.sync_routes()
    logger.info("SIGHUP: routes reloaded from %s: %s", gw.settings.config, ", ".join(gw.routing.routers) or "none")
    return True


def setup_routing(app: FastAPI, registry: CollectorRegistry) -> None:
    """In create_app: metrics, the upstream collector, the routes, the glue."""
    app.state.routing_metrics = RoutingMetrics(registry)

    def pools() -> list[Any]:
        gw = getattr(app.state, "gateway", None)
        return list(gw.pools) if gw is not None else []

    registry.register(UpstreamCollector(pools))
    registry.register(PolicyCollector(lambda: policies_of(pools())))
    app.include_router(router)


def start_routing(app: FastAPI, gw: Gateway) -> None:
    """In the lifespan, once the pools run: the table from the settings, and
    SIGHUP to reload it (undone by `stop_routing`)."""
    from server.models_setup import build_routing

    gw.install_routing(build_routing(gw.settings, gw.served_pools(), app.state.routing_metrics))
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reload_routes, gw)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):  # not the main thread, Windows
        return
    app.state.routing_sighup = loop


def stop_routing(app: FastAPI) -> None:
    loop = getattr(app.state, "routing_sighup", None)
    if loop is not None:
        app.state.routing_sighup = None
        loop.remove_signal_handler(signal.SIGHUP)
