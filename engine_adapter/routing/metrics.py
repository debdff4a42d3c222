"""Routing metrics, on the app's registry: requests per target and outcome,
fallbacks by reason, effective weights, canary rollbacks, and upstream health
per URL (read at scrape time)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter.routing.upstream import upstreams_of


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "npugw_route_requests", "Requests routed through an alias, by target and outcome "
            "(ok, error, fallback: failed before the first token and moved on, cancelled).",
            ["alias", "target", "outcome"], registry=r,
        )
        self.fallbacks = Counter(
            "npugw_route_fallbacks", "Requests moved to the next target of a fallback list, by reason "
            "(queue_full, queue_timeout, unavailable, error).",
            ["alias", "from_target", "to_target", "reason"], registry=r,
        )
        self.weight = Gauge(
            "npugw_route_weight", "Effective weight of each target of an alias (0 after a canary rollback).",
            ["alias", "target"], registry=r,
        )
        self.rollbacks = Counter(
            "npugw_canary_rollbacks", "Canary targets set to weight 0 automatically, by reason (error_rate, ttft_p95).",
            ["alias", "target", "reason"], registry=r,
        )


class UpstreamCollector(Collector):
    """Health of each upstream URL: up (1) or ejected (0), breaker state,
    requests in flight, ejections."""

    def __init__(self, pools: Callable[[], Iterable[Any]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["upstream", "url"]
        up = GaugeMetricFamily(
            "npugw_upstream_up", "1: requests go to this upstream URL; 0: it is ejected.", labels=labels
        )
        state = GaugeMetricFamily(
            "npugw_upstream_breaker_state", "Circuit breaker state per upstream URL (1 for the current one).",
            labels=[*labels, "state"],
        )
        inflight = GaugeMetricFamily(
            "npugw_upstream_outstanding_requests", "Requests in flight per upstream URL.", labels=labels
        )
        ejections = CounterMetricFamily("npugw_upstream_ejections", "Times an upstream URL was ejected.", labels=labels)
        listed = GaugeMetricFamily(
            "npugw_upstream_listed_models", "Models an upstream URL listed at its last good check.", labels=labels
        )
        now = time.monotonic()
        for u in upstreams_of(self._pools()):
            for ep in u.endpoints:
                key = [u.cfg.name, ep.url]
                current = ep.state_at(now, u.cfg.cooldown)
                up.add_metric(key, 1.0 if ep.healthy and current == "closed" else 0.0)
                for s in ("closed", "open", "half_open"):
                    state.add_metric([*key, s], 1.0 if s == current else 0.0)
                inflight.add_metric(key, ep.outstanding)
                ejections.add_metric(key, ep.ejections)
                listed.add_metric(key, len(ep.models) if u.cfg.discovers else int(ep.model_id is not None))
        yield from (up, state, inflight, ejections, listed)
