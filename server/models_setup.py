"""Settings -> the models this gateway serves and their pools."""

from __future__ import annotations

import logging
from dataclasses import replace

from engine_adapter.backends.simulated import SimulatedConfig
from engine_adapter.backends.vllm import VllmConfig
from engine_adapter.devices import detect_device
from engine_adapter.metrics import EngineMetrics
from engine_adapter.model import EMBEDDED_EMBEDDING_NAME, EMBEDDED_MODEL_NAME, resolve_model
from engine_adapter.pool import WorkerPool
from engine_adapter.registry import ModelSpec, build_pool
from server.settings import Settings

logger = logging.getLogger(__name__)


def device_for(settings: Settings) -> str:
    return detect_device() if settings.device == "auto" else settings.device


def model_specs(settings: Settings) -> list[ModelSpec]:
    s = settings
    common = dict(
        num_workers=s.num_workers,
        slots_per_worker=s.max_num_seqs,
        max_queue_size=s.max_queue_size,
        max_queue_wait=s.max_queue_wait,
        readiness_interval=s.readiness_interval,
    )
    if s.backend == "simulated":
        names = tuple(s.served_model_name) or ("simulated",)
        sim = SimulatedConfig(ttft=s.simulated_ttft, itl=s.simulated_itl, max_model_len=s.max_model_len or 4096)
        specs = [ModelSpec(names=names, backend="simulated", simulated=sim, root="simulated", **common)]  # type: ignore[arg-type]
        if s.embedding_enabled:
            specs.append(
                ModelSpec(
                    names=tuple(s.embedding_served_model_name) or ("simulated-embedding",),
                    backend="simulated",
                    simulated=replace(sim, kind="embed", max_model_len=512),
                    root="simulated-embedding",
                    **common,  # type: ignore[arg-type]
                )
            )
        return specs
    path, default_name = resolve_model(s.model)
    names = tuple(s.served_model_name) or (default_name,)
    engine = VllmConfig(
        model=str(path),
        served_model_name=names[0],
        max_model_len=s.max_model_len,
        dtype=s.dtype,
        enforce_eager=s.enforce_eager,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=s.block_size,
        enable_prefix_caching=s.enable_prefix_caching,
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        distributed_executor_backend=s.distributed_executor_backend,
        gpu_memory_utilization=s.gpu_memory_utilization,
        quantization=s.quantization,
        scheduling_policy=s.scheduling_policy,
        seed=s.seed,
        profile_dir=str(s.profile_dir.resolve()) if s.profile_dir else None,
    )
    specs = [ModelSpec(names=names, backend="vllm", vllm=engine, root=str(path), **common)]  # type: ignore[arg-type]
    if s.embedding_enabled:
        emb_arg = None if s.embedding_model == "embedded" else s.embedding_model
        emb_path, emb_name = resolve_model(emb_arg or EMBEDDED_EMBEDDING_NAME)
        emb_names = tuple(s.embedding_served_model_name) or (emb_name,)
        emb = VllmConfig(
            model=str(emb_path),
            served_model_name=emb_names[0],
            runner="pooling",
            max_model_len=None,  # the model's own (256 for all-MiniLM-L6-v2)
            max_num_seqs=min(s.max_num_seqs, 64),
            profile_dir=engine.profile_dir,
        )
        specs.append(
            ModelSpec(names=emb_names, backend="vllm", vllm=emb, root=str(emb_path),
                      **{**common, "num_workers": 1, "slots_per_worker": min(s.max_num_seqs, 64)})  # type: ignore[arg-type]
        )
    return specs


def build_served_pools(
    settings: Settings, metrics: EngineMetrics
) -> list[tuple[WorkerPool, tuple[str, ...], str]]:
    device = device_for(settings)
    logger.info("device: %s (backend %s)", device, settings.backend)
    return [(build_pool(spec, device, metrics), spec.names, spec.root) for spec in model_specs(settings)]


__all__ = ["EMBEDDED_MODEL_NAME", "build_served_pools", "device_for", "model_specs"]
