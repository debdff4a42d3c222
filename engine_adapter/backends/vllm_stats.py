"""A vLLM stat logger that feeds `EngineMetrics` from the engine's own
per-step scheduler and iteration statistics (not re-counted guesses)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm.v1.metrics.loggers import StatLoggerBase

if TYPE_CHECKING:
    from engine_adapter.backends.vllm_config import VllmConfig
    from engine_adapter.metrics import EngineMetrics, Labels


class StatsEngine(Protocol):
    """What the stat logger reads of its engine and feeds back (a VllmEngine)."""

    @property
    def config(self) -> VllmConfig: ...

    @property
    def index(self) -> int: ...

    def record_scheduler(self, running: int, waiting: int, kv: float) -> None: ...


class GatewayStatLogger(StatLoggerBase):
    def __init__(self, engine: StatsEngine, metrics: EngineMetrics | None) -> None:
        self._engine = engine
        self._metrics = metrics
        self._at: Labels = (engine.config.served_model_name, str(engine.index))
        cfg = engine.config
        self._max_lora = (cfg.max_loras or 1) if cfg.enable_lora else 0

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        m = self._metrics
        if scheduler_stats is not None:
            running = int(scheduler_stats.num_running_reqs)
            waiting = int(scheduler_stats.num_waiting_reqs) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )
            kv = float(scheduler_stats.kv_cache_usage)
            self._engine.record_scheduler(running, waiting, kv)
            if m is not None:
                m.set_scheduler(self._at, running, waiting, kv)
                pc = scheduler_stats.prefix_cache_stats
                m.add_prefix_cache(self._at, int(pc.queries), int(pc.hits))
                if self._max_lora:
                    m.set_lora_info(
                        self._at, self._max_lora,
                        getattr(scheduler_stats, "waiting_lora_adapters", None) or {},
                        getattr(scheduler_stats, "running_lora_adapters", None) or {},
                    )
        if iteration_stats is None or m is None:
            return
        pts = iteration_stats.prompt_token_stats
        m.observe_iteration(
            self._at,
            prompt_tokens=int(iteration_stats.num_prompt_tokens),
            generation_tokens=int(iteration_stats.num_generation_tokens),
            preemptions=int(iteration_stats.num_preempted_reqs),
            ttfts=iteration_stats.time_to_first_tokens_iter,
            itls=iteration_stats.inter_token_latencies_iter,
            batch_tokens=int(pts.computed) + int(iteration_stats.num_generation_tokens),
        )
        for fr in iteration_stats.finished_requests:
            m.observe_finished(
                self._at,
                reason=str(fr.finish_reason),
                e2e=float(fr.e2e_latency),
                queued=float(fr.queued_time),
                prompt_tokens=int(fr.num_prompt_tokens),
                generation_tokens=int(fr.num_generation_tokens),
            )

    def log_engine_initialized(self) -> None:
        return None


def make_stat_logger_factory(engine: StatsEngine, metrics: EngineMetrics | None) -> Any:
    def factory(vllm_config: Any, engine_index: int = 0) -> GatewayStatLogger:
        return GatewayStatLogger(engine, metrics)

    return factory
