"""The routing policies by name (`--routing-policy`), and their metrics:
the one place that knows every policy, the `kv-events` one included, so
that routing/policy.py (the interface and the guesses) needs none of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter.routing.kv_events import KvEventsPolicy
from engine_adapter.routing.kv_metrics import kv_families
from engine_adapter.routing.policy import (
    MATCH_BUCKETS,
    POLICIES,
    REASONS,
    PolicyOptions,
    PrefixPolicy,
    RoutingPolicy,
    SessionPolicy,
)


def make_policy(
    name: str, opts: PolicyOptions | None = None, unit: str = "tokens", sources: Mapping[int, Any] | None = None
) -> RoutingPolicy:
    """`sources`: kv-events only, each engine's KvSource (routing/kv_events.py)."""
    o = opts or PolicyOptions()
    if name == "least-outstanding":
        return RoutingPolicy()
    if name == "session":
        return SessionPolicy()
    if name == "prefix":
        return PrefixPolicy(
            block_tokens=o.block_tokens, block_bytes=o.block_bytes, max_blocks=o.max_blocks,
            balance_abs=o.balance_abs, balance_rel=o.balance_rel, unit=unit, min_block_tokens=o.min_block_tokens,
        )
    if name == "kv-events":
        return KvEventsPolicy(
            sources, block_tokens=o.block_tokens, block_bytes=o.block_bytes, max_blocks=o.max_blocks,
            balance_abs=o.balance_abs, balance_rel=o.balance_rel, unit=unit, min_block_tokens=o.min_block_tokens,
        )
    raise ValueError(f"routing policy {name!r}: expected one of {', '.join(POLICIES)}")


class PolicyCollector(Collector):
    """Routing decisions by reason and matched prefix lengths, per model
    (pools' worker choice and upstreams' URL choice), read at scrape time."""

    def __init__(self, policies: Callable[[], Iterable[tuple[str, RoutingPolicy]]]) -> None:
        self._policies = policies

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "npugw_route_policy_decisions",
            "Engine choices of each model's routing policy, by reason (least_outstanding, session, "
            "kv_hit, prefix_hit, load_fallback, no_match).",
            labels=["model", "policy", "reason"],
        )
        matched = HistogramMetricFamily(
            "npugw_route_prefix_match_length",
            "Prompt prefix matched by the prefix policy (unit: tokens for local engines, bytes of the "
            "request's JSON for upstream nodes).",
            labels=["model", "unit"],
        )
        kv = []
        for model, p in self._policies():
            if p.name == "kv-events":
                kv.append((model, p))
            s = p.stats
            for reason in REASONS:
                if s.decisions[reason]:
                    decisions.add_metric([model, p.name, reason], s.decisions[reason])
            if isinstance(p, PrefixPolicy):
                acc, buckets = 0, []
                for bound, count in zip(MATCH_BUCKETS, s.match_buckets, strict=True):
                    acc += count
                    buckets.append((str(float(bound)), acc))
                buckets.append(("+Inf", s.match_count))
                matched.add_metric([model, p.unit], buckets, s.match_sum)
        yield decisions
        yield matched
        if kv:
            yield from kv_families(kv)  # type: ignore[arg-type]


def policies_of(pools: Iterable[Any]) -> Iterator[tuple[str, RoutingPolicy]]:
    """(model, policy) of each pool and of each upstream behind a pool."""
    seen: set[int] = set()
    for pool in pools:
        policy = getattr(pool, "policy", None)
        if isinstance(policy, RoutingPolicy) and len(getattr(pool, "workers", ())) > 1:
            yield pool.name, policy
        for w in getattr(pool, "workers", ()):
            up = getattr(w.engine, "upstream", None)
            p = getattr(up, "policy", None)
            if isinstance(p, RoutingPolicy) and id(up) not in seen:
                seen.add(id(up))
                yield up.cfg.name, p  # type: ignore[union-attr]
