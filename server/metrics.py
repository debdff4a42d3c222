"""The gateway's own metrics, one registry per app instance.

Pool state (queue depth, rejections, workers) is read at scrape time by a
collector, so the request path pays nothing for it.
"""

from __future__ import annotations

import asyncio
from collections import Counter as CounterDict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter.metrics import Children
from engine_adapter.pool import WorkerPool


class PoolCollector(Collector):
    def __init__(
        self,
        pools: Callable[[], list[WorkerPool]],
        other_rejections: Callable[[], dict[tuple[str, str], int]],
    ) -> None:
        self._pools = pools
        self._other = other_rejections

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "npugw_queue_depth", "Requests waiting in the gateway's queue.", labels=["model_name", "priority"]
        )
        running = GaugeMetricFamily(
            "npugw_requests_running", "Requests holding an engine slot.", labels=["model_name"]
        )
        rejected = CounterMetricFamily(
            "npugw_admission_rejections",
            "Requests refused before reaching an engine, by reason.",
            labels=["model_name", "reason"],
        )
        alive = GaugeMetricFamily("npugw_workers_alive", "Workers whose engine runs.", labels=["model_name"])
        ready = GaugeMetricFamily(
            "npugw_workers_ready", "Workers that passed a real generation recently.", labels=["model_name"]
        )
        restarts = CounterMetricFamily("npugw_worker_restarts", "Engine restarts.", labels=["model_name"])
        unfinished = GaugeMetricFamily(
            "npugw_engine_unfinished_requests",
            "Requests the engine holds right now (read live at scrape time).",
            labels=["model_name", "engine"],
        )
        for p in self._pools():
            by_prio = p.queue_depth_by_priority() or {0: 0}
            for prio, n in by_prio.items():
                depth.add_metric([p.name, str(prio)], n)
            running.add_metric([p.name], p.running)
            for reason in ("queue_full", "queue_timeout", "deadline_unmeetable", "deadline_expired", "no_worker",
                           "shutting_down"):
                rejected.add_metric([p.name, reason], p.counters.rejected.get(reason, 0))
            if not p.deferred:  # an engine that starts on first use has no workers yet
                alive.add_metric([p.name], p.alive_workers())
                ready.add_metric([p.name], p.ready_workers())
            restarts.add_metric([p.name], sum(w.restarts for w in p.workers))
            for w in p.workers:
                try:
                    n = w.engine.stats().unfinished if w.alive else 0
                except Exception:  # a dying engine must not break the scrape
                    n = 0
                unfinished.add_metric([p.name, str(w.index)], n)
        for (model, reason), n in self._other().items():
            rejected.add_metric([model, reason], n)
        yield from (depth, running, rejected, alive, ready, restarts, unfinished)


class LoopCollector(Collector):
    """The serving process's event loop, read at scrape time (a leak shows as
    a count that grows while the load does not): `npugw_asyncio_tasks`, the
    tasks not yet done. The scrape runs on the loop (the /metrics route, or
    the multiprocess export); outside a running loop nothing is exported."""

    def collect(self) -> Iterator[Metric]:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        tasks = GaugeMetricFamily("npugw_asyncio_tasks", "Tasks of the gateway's event loop that are not done.")
        tasks.add_metric([], len(asyncio.all_tasks(loop)))
        yield tasks


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = registry
        self._child = Children()
        self.http_requests = Counter(
            "npugw_http_requests", "HTTP requests by route and status.", ["route", "method", "status"], registry=r
        )
        self.http_duration = Histogram(
            "npugw_http_request_duration_seconds",
            "Time to the end of the response, by route.",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self._rejections: CounterDict[tuple[str, str]] = CounterDict()
        # Requests by route in this process; kept only with several gateway
        # processes (server/metrics_multiproc.py exports it per process).
        self.process_requests: CounterDict[str] | None = None
        self.key_requests = Counter(
            "npugw_api_key_requests", "Requests per API key name (never the key).",
            ["api_key_name", "model_name"], registry=r,
        )
        self.key_tokens = Counter(
            "npugw_api_key_tokens", "Tokens per API key name, by type (prompt, completion).",
            ["api_key_name", "model_name", "type"], registry=r,
        )

    def rejected(self, model: str, reason: str) -> None:
        self._rejections[(model, reason)] += 1

    def rejections(self) -> dict[tuple[str, str], int]:
        return dict(self._rejections)

    def http_done(self, route: str, method: str, status: int, seconds: float) -> None:
        self._child(self.http_requests, route, method, str(status)).inc()
        self._child(self.http_duration, route).observe(seconds)
        if self.process_requests is not None:
            self.process_requests[route] += 1

    def key_request(self, name: str | None, model: str) -> None:
        self._child(self.key_requests, name or "anonymous", model).inc()

    def key_used(self, name: str | None, model: str, prompt: int, completion: int) -> None:
        who = name or "anonymous"
        if prompt:
            self._child(self.key_tokens, who, model, "prompt").inc(prompt)
        if completion:
            self._child(self.key_tokens, who, model, "completion").inc(completion)
