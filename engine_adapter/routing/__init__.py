"""Routing between served models: aliases with weights (canaries), sticky
sessions, automatic canary rollback, ordered fallbacks, and the upstreams of
the `remote` backend (balancing, circuit breakers, health checks)."""

from engine_adapter.routing.metrics import RoutingMetrics, UpstreamCollector
from engine_adapter.routing.router import Router, RouterLocalLease, RouterRelayLease, ServedPool
from engine_adapter.routing.spec import CanaryPolicy, RouteSpec, parse_alias, parse_fallback, route_specs
from engine_adapter.routing.table import RoutingTable

__all__ = [
    "CanaryPolicy",
    "RouteSpec",
    "Router",
    "RouterLocalLease",
    "RouterRelayLease",
    "RoutingMetrics",
    "RoutingTable",
    "ServedPool",
    "UpstreamCollector",
    "parse_alias",
    "parse_fallback",
    "route_specs",
]
