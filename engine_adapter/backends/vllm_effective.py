"""What the engine really runs with, once vLLM and its platform plugin have
had their say: read from AsyncLLM's `vllm_config` after start, logged,
compared with the flags the operator gave (vllm-ascend replaces some, e.g.
the block size), and exported as info gauges the way vLLM exports
`vllm:cache_config_info`. Reads attributes only; imports no vllm."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EffectiveConfig:
    block_size: int | None
    enable_prefix_caching: bool | None
    cache_dtype: str
    num_gpu_blocks: int | None  # KV cache blocks (vLLM's name on every device)
    gpu_memory_utilization: float | None
    enforce_eager: bool
    graph_mode: str  # "eager", or vLLM's CUDAGraphMode name (ACL graphs on Ascend)
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    max_model_len: int | None
    quantization: str | None
    dtype: str

    @property
    def kv_cache_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size


def _name(value: Any) -> str:
    """'torch.bfloat16' -> 'bfloat16', CUDAGraphMode.FULL -> 'FULL'."""
    text = getattr(value, "name", None)
    if not isinstance(text, str):
        text = str(value)
    return text.removeprefix("torch.")


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_effective(vllm_config: Any) -> EffectiveConfig:
    """From vLLM's VllmConfig (the front end's copy: vLLM copies the KV block
    count back into it from the engine core at start-up)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    eager = bool(getattr(model, "enforce_eager", False))
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    if eager or mode is None or _name(mode) == "NONE":
        graph = "eager"
    else:
        graph = _name(mode)
    quant = getattr(model, "quantization", None)
    util = getattr(cache, "gpu_memory_utilization", None)
    return EffectiveConfig(
        block_size=_int(getattr(cache, "block_size", None)),
        enable_prefix_caching=getattr(cache, "enable_prefix_caching", None),
        cache_dtype=_name(getattr(cache, "cache_dtype", "auto")),
        num_gpu_blocks=_int(getattr(cache, "num_gpu_blocks", None)),
        gpu_memory_utilization=float(util) if util is not None else None,
        enforce_eager=eager,
        graph_mode=graph,
        max_num_batched_tokens=_int(getattr(sched, "max_num_batched_tokens", None)),
        max_num_seqs=_int(getattr(sched, "max_num_seqs", None)),
        max_model_len=_int(getattr(model, "max_model_len", None)),
        quantization=str(quant) if quant else None,
        dtype=_name(getattr(model, "dtype", "auto")),
    )


def describe(eff: EffectiveConfig) -> str:
    kv = f"{eff.num_gpu_blocks} blocks = {eff.kv_cache_tokens} tokens" if eff.num_gpu_blocks else "unknown"
    return (
        f"block_size={eff.block_size} prefix_caching={eff.enable_prefix_caching} graph={eff.graph_mode} "
        f"max_num_batched_tokens={eff.max_num_batched_tokens} max_num_seqs={eff.max_num_seqs} "
        f"max_model_len={eff.max_model_len} dtype={eff.dtype} quantization={eff.quantization or 'none'} "
        f"kv_cache_dtype={eff.cache_dtype} kv_cache={kv}"
    )


# Engine argument -> (EffectiveConfig field, flag).
WATCHED_ARGS = {
    "block_size": ("block_size", "--block-size"),
    "enable_prefix_caching": ("enable_prefix_caching", "--enable-prefix-caching"),
    "enforce_eager": ("enforce_eager", "--enforce-eager"),
    "max_num_batched_tokens": ("max_num_batched_tokens", "--max-num-batched-tokens"),
    "max_num_seqs": ("max_num_seqs", "--max-num-seqs"),
    "max_model_len": ("max_model_len", "--max-model-len"),
    "quantization": ("quantization", "--quantization"),
    "kv_cache_dtype": ("cache_dtype", "--engine-arg kv_cache_dtype"),
    "dtype": ("dtype", "--dtype"),
}
# Why a platform replaces a flag, where known.
_WHY = {
    ("npu", "block_size"): "vllm-ascend uses 128 when prefix caching or chunked prefill is on",
}


def platform_overrides(given: Mapping[str, Any], eff: EffectiveConfig, device: str) -> list[str]:
    """One line per flag the operator gave whose value the engine does not
    run with. `given`: the engine arguments the operator set (not defaults)."""
    out = []
    for key, value in given.items():
        if key not in WATCHED_ARGS or value is None or (key in ("dtype", "kv_cache_dtype") and value == "auto"):
            continue
        field_name, flag = WATCHED_ARGS[key]
        have = getattr(eff, field_name)
        same = _name(have) == _name(value) if isinstance(value, str) else have == value
        if not same:
            why = _WHY.get((device, key))
            out.append(f"{flag} {value} is replaced by {have} on {device}" + (f" ({why})" if why else ""))
    return out


def graph_notice(eff: EffectiveConfig, device: str, given: Mapping[str, Any]) -> str | None:
    """Graph capture chosen by the platform, not by the operator."""
    if device not in ("npu", "gpu") or eff.graph_mode == "eager" or given.get("enforce_eager") is not None:
        return None
    what = "ACL graph capture" if device == "npu" else "CUDA graph capture"
    return (
        f"{what} is on (cudagraph_mode={eff.graph_mode}): longer start-up and more device memory; "
        "--enforce-eager turns it off"
    )


def report(eff: EffectiveConfig, given: Mapping[str, Any], device: str, model: str, engine: int) -> None:
    """Log the effective configuration and warn about what the platform chose."""
    logger.info("engine %d (%s, %s) runs with %s", engine, model, device, describe(eff))
    for line in platform_overrides(given, eff, device):
        logger.warning("engine %d (%s): %s", engine, model, line)
    notice = graph_notice(eff, device, given)
    if notice:
        logger.warning("engine %d (%s): %s", engine, model, notice)


# ------------------------------------------------------------ info gauges

_CACHE_LABELS = ("block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching", "gpu_memory_utilization")
_ENGINE_LABELS = (
    "device", "graph_mode", "enforce_eager", "max_num_batched_tokens", "max_num_seqs",
    "max_model_len", "quantization", "dtype", "kv_cache_tokens",
)
_gauges: weakref.WeakKeyDictionary[CollectorRegistry, tuple[Gauge, Gauge]] = weakref.WeakKeyDictionary()
# The label values last exported per (gauge, (model, engine)).
_exported: weakref.WeakKeyDictionary[CollectorRegistry, dict[tuple[int, tuple[str, str]], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _info_gauges(registry: CollectorRegistry) -> tuple[Gauge, Gauge]:
    pair = _gauges.get(registry)
    if pair is None:
        base = ["model_name", "engine"]
        cache = Gauge(
            "vllm:cache_config_info", "Information of the engine's CacheConfig (as the engine runs it).",
            [*base, *_CACHE_LABELS], registry=registry,
        )
        engine = Gauge(
            "npugw_engine_config_info",
            "The engine's effective configuration after the platform's changes (graph mode, batch limits, "
            "quantization, KV cache size in tokens).",
            [*base, *_ENGINE_LABELS], registry=registry,
        )
        pair = _gauges[registry] = (cache, engine)
    return pair


def _label(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def export_info(registry: CollectorRegistry, eff: EffectiveConfig, device: str, model: str, engine: int) -> None:
    """Info gauges (value 1, facts in the labels) for this engine; a restarted
    engine's series replaces its predecessor's."""
    gauges = _info_gauges(registry)
    values = {**asdict(eff), "kv_cache_tokens": eff.kv_cache_tokens, "device": device}
    base = (model, str(engine))
    seen = _exported.setdefault(registry, {})
    for gauge, names in zip(gauges, (_CACHE_LABELS, _ENGINE_LABELS), strict=True):
        labels = (*base, *(_label(values[k]) for k in names))
        old = seen.get((id(gauge), base))
        if old is not None and old != labels:
            gauge.remove(*old)
        gauge.labels(*labels).set(1)
        seen[(id(gauge), base)] = labels
