"""Engine metrics under vLLM's own names, so existing dashboards work.

Fed from the engine's real statistics (the vLLM stat logger in
`backends/vllm_stats.py`). One `EngineMetrics` per app registry, so tests are
isolated. Also the names the seed deployment's PromQL queries.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)
# One engine's label values (model_name, engine), as its stat logger holds them.
Labels = tuple[str, str]


class Children:
    """`metric.labels(*values)` looked up once per label set: `labels()`
    validates and takes a lock on every call, and the request path calls it
    for the same few label sets over and over."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}

    def __call__(self, metric: M, *values: str) -> M:
        key = (id(metric), values)
        child = self._seen.get(key)
        if child is None:
            child = self._seen[key] = metric.labels(*values)
        return child  # type: ignore[return-value]  # labels() returns the metric's own type

# vLLM's buckets, so dashboards built for vLLM read the same quantiles.
_LATENCY = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_ITL = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_E2E = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)


def _token_buckets(max_len: int) -> list[float]:
    out: list[float] = []
    base = 1
    while base <= max_len:
        for m in (1, 2, 5):
            if base * m <= max_len:
                out.append(float(base * m))
        base *= 10
    return out or [1.0]


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, max_model_len: int = 8192) -> None:
        self._child = Children()
        L = ["model_name", "engine"]
        r = registry
        self.registry = registry  # for the engines' info gauges (backends/vllm_effective.py)
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", L, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", L, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", L, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", L, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*L, "finished_reason"], registry=r
        )
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", L, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", L, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", L, registry=r)
        tok = _token_buckets(max_model_len)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of tokens per engine step.", L,
            buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", L, buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", L, buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End to end request latency in seconds.", L, buckets=_E2E, registry=r
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time spent in the engine's WAITING phase.", L, buckets=_E2E, registry=r
        )
        self.req_prompt = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", L, buckets=tok, registry=r
        )
        self.req_generation = Histogram(
            "vllm:request_generation_tokens", "Generation tokens per request.", L, buckets=tok, registry=r
        )
        # vLLM's LoRA info gauge, named and labelled as vLLM does (value: the
        # time of the last update), plus model_name and engine; only each
        # engine's latest label set is kept (vLLM keeps every one it saw).
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            [*L, "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r,
        )
        self._lora_last: dict[tuple[str, str], tuple[str, ...]] = {}
        # The seed deployment's names (its PromQL must keep working).
        self.seed_running = Gauge("vllm_num_running_requests", "Requests running on the engine.", L, registry=r)
        self.seed_batch_tokens = Counter(
            "vllm_batch_tokens_processed", "Tokens processed by engine steps (prefill + decode).", L, registry=r
        )

    def init_engine(self, model: str, engine: int) -> None:
        """Create every per-engine series at 0, so a quiet engine exports
        samples (a panel shows 0, not "No data")."""
        e = str(engine)
        for m in (
            self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
            self.preemptions, self.prefix_queries, self.prefix_hits, self.iteration_tokens, self.ttft,
            self.itl, self.e2e, self.queue_time, self.req_prompt, self.req_generation, self.seed_running,
            self.seed_batch_tokens,
        ):
            m.labels(model, e)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model, e, reason)

    def set_scheduler(self, at: Labels, running: int, waiting: int, kv_usage: float) -> None:
        self._child(self.running, *at).set(running)
        self._child(self.seed_running, *at).set(running)
        self._child(self.waiting, *at).set(waiting)
        self._child(self.kv_usage, *at).set(kv_usage)

    def set_lora_info(self, at: Labels, max_lora: int, waiting: Iterable[str], running: Iterable[str]) -> None:
        labels = (*at, str(max_lora), ",".join(waiting), ",".join(running))
        last = self._lora_last.get(labels[:2])
        if last is not None and last != labels:
            self.lora_info.remove(*last)
        self._lora_last[labels[:2]] = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def add_prefix_cache(self, at: Labels, queries: int, hits: int) -> None:
        if queries:
            self._child(self.prefix_queries, *at).inc(queries)
        if hits:
            self._child(self.prefix_hits, *at).inc(hits)

    def observe_iteration(
        self,
        at: Labels,
        prompt_tokens: int,
        generation_tokens: int,
        preemptions: int,
        ttfts: Iterable[float],
        itls: Iterable[float],
        batch_tokens: int | None = None,
    ) -> None:
        """One engine step. `batch_tokens`: tokens the step computed (prompt
        tokens not served from the prefix cache, plus generated ones)."""
        self._child(self.prompt_tokens, *at).inc(prompt_tokens)
        self._child(self.generation_tokens, *at).inc(generation_tokens)
        if preemptions:
            self._child(self.preemptions, *at).inc(preemptions)
        batch = prompt_tokens + generation_tokens if batch_tokens is None else batch_tokens
        self._child(self.iteration_tokens, *at).observe(batch)
        self._child(self.seed_batch_tokens, *at).inc(batch)
        ttft = self._child(self.ttft, *at)
        for v in ttfts:
            ttft.observe(v)
        itl = self._child(self.itl, *at)
        for v in itls:
            itl.observe(v)

    def observe_finished(
        self,
        at: Labels,
        reason: str,
        e2e: float,
        queued: float,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        self._child(self.success, *at, reason).inc()
        self._child(self.e2e, *at).observe(e2e)
        self._child(self.queue_time, *at).observe(queued)
        self._child(self.req_prompt, *at).observe(prompt_tokens)
        self._child(self.req_generation, *at).observe(generation_tokens)
