"""Fair share and deadline-aware admission, the HTTP side: the queue policy
and the keys' weights onto the pools (at start and on a SIGHUP reload), and
the queue's metrics (a request's TTFT deadline: server/ask.py
`ttft_deadline`). The queue itself is
engine_adapter/scheduler.py; the admission that uses it,
engine_adapter/admission.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter.pool import WorkerPool
from engine_adapter.scheduler import Histogram
from server.auth import KeyEntry
from server.settings import Settings

logger = logging.getLogger(__name__)

RESERVE_REASONS = ("new_flow", "priority")  # why a request took a reserve slot (engine_adapter/admission.py)
REFUSALS = ("queue_full", "queue_timeout", "deadline_unmeetable", "deadline_expired", "no_worker", "shutting_down")


def configure_queues(pools: Sequence[WorkerPool], policy: str, entries: Sequence[KeyEntry]) -> None:
    """Every pool's queue policy and the keys' weights."""
    weights = {e.name: e.weight for e in entries if e.weight != 1.0}
    for p in pools:
        p.set_queue_policy(policy)  # type: ignore[arg-type]
        p.queue.weights = weights


def reload_queue_policy(pools: Sequence[WorkerPool], fresh: Settings) -> None:
    """SIGHUP: the policy of the reloaded settings; queued requests stay."""
    for p in pools:
        if p.queue_policy != fresh.queue_policy:
            logger.info("SIGHUP: %s: queue policy %s -> %s (%d queued stay)", p.name, p.queue_policy,
                        fresh.queue_policy, p.queue_depth)
            p.set_queue_policy(fresh.queue_policy)


def _who(tenant: str) -> str:
    return tenant or "anonymous"


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    return [(b, float(n)) for b, n in h.cumulative()]


class QueueCollector(Collector):
    """Per key: queue wait, depth, refusals by reason; per model: the
    saturation gauge for autoscaling, the estimated queue wait, and how far
    off the wait estimates were. Read at scrape time."""

    def __init__(self, pools: Callable[[], list[WorkerPool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        wait = HistogramMetricFamily(
            "npugw_queue_wait_seconds", "Time a request waited for an engine slot, per API key.",
            labels=["model_name", "api_key_name"],
        )
        depth = GaugeMetricFamily(
            "npugw_queue_depth_by_key", "Requests waiting in the queue, per API key.",
            labels=["model_name", "api_key_name"],
        )
        refused = CounterMetricFamily(
            "npugw_queue_refusals", "Requests refused by admission, per API key and reason.",
            labels=["model_name", "api_key_name", "reason"],
        )
        saturation = GaugeMetricFamily(
            "npugw_queue_saturation",
            "Requests running or queued over the engine slots of live workers (1: every slot taken; "
            "above 1: a queue builds). For autoscaling.",
            labels=["model_name"],
        )
        est_wait = GaugeMetricFamily(
            "npugw_queue_estimated_wait_seconds",
            "The queued work over the measured service rate (0 until measured).", labels=["model_name"],
        )
        err = HistogramMetricFamily(
            "npugw_queue_wait_estimate_error_seconds",
            "|actual - estimated| queue wait of requests admitted with an estimate.", labels=["model_name"],
        )
        bias = GaugeMetricFamily(
            "npugw_queue_wait_estimate_bias_seconds",
            "Mean (actual - estimated) queue wait: above 0 the estimate is low.", labels=["model_name"],
        )
        reserve = CounterMetricFamily(
            "npugw_queue_reserve_admissions",
            "Requests admitted into a reserve slot (--fair-reserve-slots) instead of waiting, by reason: "
            "new_flow (their key had nothing running nor queued), priority (more urgent than every running "
            "request).",
            labels=["model_name", "reason"],
        )
        reserve_running = GaugeMetricFamily(
            "npugw_queue_reserve_running", "Reserve slots (--fair-reserve-slots) taken now.", labels=["model_name"],
        )
        for p in self._pools():
            stats = p.queue_stats
            for tenant, h in stats.wait.items():
                wait.add_metric([p.name, _who(tenant)], _buckets(h), h.total)
            by_key = p.queue.depth_by_tenant()
            for tenant in set(by_key) | set(stats.wait):
                depth.add_metric([p.name, _who(tenant)], by_key.get(tenant, 0))
            for (tenant, reason), n in stats.refused.items():
                refused.add_metric([p.name, _who(tenant), reason], n)
            saturation.add_metric([p.name], p.saturation())
            est_wait.add_metric([p.name], p.estimated_wait() or 0.0)
            e = stats.estimate_error
            err.add_metric([p.name], _buckets(e), e.total)
            bias.add_metric([p.name], stats.estimate_bias / e.n if e.n else 0.0)
            if any(w.reserve for w in p.workers):
                for reason in RESERVE_REASONS:
                    reserve.add_metric([p.name, reason], stats.reserve_admitted[reason])
                reserve_running.add_metric([p.name], p.reserve_running)
        yield from (wait, depth, refused, saturation, est_wait, err, bias, reserve, reserve_running)


def describe(p: WorkerPool, upcoming: int = 8) -> dict[str, Any]:
    """What GET /admin/queue shows of one pool."""
    rate = p.queue_stats.rate.per_second
    return {
        "policy": p.queue_policy,
        "depth": p.queue_depth,
        "depth_by_priority": {str(k): v for k, v in sorted(p.queue_depth_by_priority().items())},
        "keys": {
            _who(t): {"queued": n, "running": p.admission.running_by_tenant.get(t, 0), "weight": p.queue.weight(t)}
            for t, n in sorted({**dict.fromkeys(p.admission.running_by_tenant, 0),
                                **p.queue.depth_by_tenant()}.items())
        },
        "next": [{"api_key_name": _who(w.tenant), "priority": w.priority, "cost": w.cost}
                 for w in p.queue.upcoming(upcoming)],
        "running": p.running,
        "capacity": p.capacity,
        "reserve": p.reserve,
        "reserve_running": p.reserve_running,
        "reserve_admissions": {r: p.queue_stats.reserve_admitted[r] for r in RESERVE_REASONS},
        "saturation": round(p.saturation(), 4),
        "service_rate_tokens_per_s": round(rate, 2) if rate else None,
        "estimated_wait_s": round(w, 3) if (w := p.estimated_wait()) is not None else None,
    }
