"""Settings -> the models this gateway serves and their pools."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import replace

from engine_adapter.backends.simulated import SimulatedConfig
from engine_adapter.backends.vllm_config import CPU_BIND_ENV, VllmConfig
from engine_adapter.backends.vllm_env import cpu_cores, cpu_list
from engine_adapter.backends.vllm_plugin import BUSY_LOOP_ENV
from engine_adapter.devices import detect_device
from engine_adapter.metrics import EngineMetrics
from engine_adapter.model import EMBEDDED_EMBEDDING_NAME, EMBEDDED_MODEL_NAME, resolve_model
from engine_adapter.pool import WorkerPool
from engine_adapter.registry import ModelSpec, build_pool
from engine_adapter.routing import CanaryPolicy, RoutingMetrics, RoutingTable, ServedPool
from engine_adapter.routing.kv_sources import local_sources, remote_kv_policy
from engine_adapter.routing.policies import make_policy
from engine_adapter.routing.policy import PolicyOptions
from engine_adapter.routing.upstream import upstreams_of
from server.placement import engine_placement, log_placement
from server.settings import Settings

logger = logging.getLogger(__name__)


def device_for(settings: Settings) -> str:
    return detect_device() if settings.device == "auto" else settings.device


# With this many cores, the embedding engine's core ("auto") is taken out of
# the generators' set; below it, giving up a core costs the generators more
# than sharing one with a mostly idle engine.
DISJOINT_EMBEDDING_CORES = 16

# On CPU the embedding engine's worker, after each step (a readiness probe of
# an idle engine: every --readiness-interval), spins with sched_yield() for
# vLLM's 1 s on a core the generator computes on. Measured (issue 15,
# bench/results/e2e_embspin1.json): the default's ITL p99 at c=16 2.47x
# `vllm serve`'s with 1 s, 1.14x with 50 ms. The steps of one embedding
# request follow each other within milliseconds, inside 50 ms.
CPU_EMBEDDING_BUSY_LOOP = 0.05


def embedding_busy_loop(settings: Settings) -> float | None:
    if settings.embedding_busy_loop is not None:
        return settings.embedding_busy_loop
    return CPU_EMBEDDING_BUSY_LOOP if device_for(settings) == "cpu" else None


def embedding_lazy(settings: Settings) -> bool:
    """Whether the embedding engine starts on its first request. On CPU by
    default: idle, it still cost the generator's token latency (ITL p99 at
    c=64 1.8-2.6x `vllm serve`'s with it, 0.9-1.1x without, bench/results/
    e2e_embspin1.json and e2e_embspin_noprobe.json)."""
    if settings.embedding_start != "auto":
        return settings.embedding_start == "lazy"
    return device_for(settings) == "cpu"


def cpu_binds(settings: Settings, cores: list[int] | None = None) -> tuple[str | None, str | None]:
    """(generators' VLLM_CPU_OMP_THREADS_BIND or None for the default,
    embedding engine's or None for the generators') on a CPU device.

    The embedding engine, idle most of the time, must not put OpenMP threads
    on every core the generator computes on: by default it gets one thread
    on the last core."""
    s = settings
    if device_for(s) != "cpu" or s.embedding_cpu_bind == "shared":
        return None, None
    if s.embedding_cpu_bind != "auto":
        return None, s.embedding_cpu_bind
    cores = cpu_cores() if cores is None else sorted(cores)
    if not cores:
        return None, None
    own = cores[-1:]
    user_set = "VLLM_CPU_OMP_THREADS_BIND" in os.environ
    if len(cores) >= DISJOINT_EMBEDDING_CORES and not user_set:
        return cpu_list(cores[:-1]), cpu_list(own)
    return None, cpu_list(own)


def worker_binds(settings: Settings, gen_bind: str | None, cores: list[int] | None = None) -> tuple[str, ...]:
    """Each generation worker's own OpenMP cores on a CPU device, by worker
    index: the generators' cores (`gen_bind`, else every core) cut into
    `--num-workers` contiguous shares. Two engines on the same cores run
    twice the OpenMP threads the cores have, and their spinning threads
    take turns. Empty (every worker on every core) for one worker, fewer
    cores than workers, `--worker-cpu-bind shared`, or a
    VLLM_CPU_OMP_THREADS_BIND the user set."""
    s, n = settings, settings.num_workers
    if n < 2 or s.worker_cpu_bind == "shared" or device_for(s) != "cpu" or CPU_BIND_ENV in os.environ:
        return ()
    if gen_bind is not None:
        cores = parse_cpu_list(gen_bind)
    elif cores is None:
        cores = cpu_cores()
    cores = sorted(cores)
    if len(cores) < n:
        logger.warning("--num-workers %d on %d cores: every worker's OpenMP threads on all of them", n, len(cores))
        return ()
    q, r = divmod(len(cores), n)
    shares, at = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        shares.append(cpu_list(cores[at:at + size]))
        at += size
    return tuple(shares)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (VLLM_CPU_OMP_THREADS_BIND syntax)."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def embedding_env(bind: str | None, busy_loop: float | None) -> tuple[tuple[str, str], ...]:
    """The embedding engine's process environment: its OpenMP cores, and the
    spin of its shared-memory queue readers (engine_adapter/backends/vllm_plugin.py)."""
    env: tuple[tuple[str, str], ...] = (("VLLM_CPU_OMP_THREADS_BIND", bind),) if bind else ()
    if busy_loop is not None:
        env += ((BUSY_LOOP_ENV, f"{busy_loop:g}"),)
    return env


def model_specs(settings: Settings) -> list[ModelSpec]:
    s = settings
    if s.gateway_only:
        logger.info("--model none: no local engine; serving the upstream nodes only")
        return []
    common = dict(
        num_workers=s.num_workers,
        slots_per_worker=s.max_num_seqs,
        reserve_slots=s.fair_reserve_slots,
        max_queue_size=s.max_queue_size,
        max_queue_wait=s.max_queue_wait,
        readiness_interval=s.readiness_interval,
    )
    if s.backend == "simulated":
        names = tuple(s.served_model_name) or ("simulated",)
        sim = SimulatedConfig(ttft=s.simulated_ttft, itl=s.simulated_itl, max_model_len=s.max_model_len or 4096,
                              lora=s.enable_lora)
        specs = [ModelSpec(names=names, backend="simulated", simulated=sim, root="simulated", **common)]  # type: ignore[arg-type]
        for extra_names, where in s.extra_models():
            specs.append(ModelSpec(names=extra_names, backend="simulated", simulated=sim, root=where, **common))  # type: ignore[arg-type]
        if s.embedding_enabled:
            specs.append(
                ModelSpec(
                    names=tuple(s.embedding_served_model_name) or ("simulated-embedding",),
                    backend="simulated",
                    simulated=replace(sim, kind="embed", max_model_len=512, lora=False),
                    root="simulated-embedding",
                    lazy=s.embedding_start == "lazy",  # only when asked: "auto" means the real engine's cost
                    **{**common, "reserve_slots": 0},  # type: ignore[arg-type]
                )
            )
        return specs
    # Before anything else: a placement that does not fit is refused before
    # any model is prepared or any engine starts.
    placement = engine_placement(s, device_for(s))
    if placement is not None:
        log_placement(placement)
    path, default_name = resolve_model(s.model)
    names = tuple(s.served_model_name) or (default_name,)
    default_policy, per_model = s.parsed.policies
    gen_bind, emb_bind = cpu_binds(s) if s.embedding_enabled else (None, None)
    engine = VllmConfig(
        model=str(path),
        served_model_name=names[0],
        max_model_len=s.max_model_len,
        dtype=s.dtype,
        enforce_eager=s.enforce_eager,
        max_num_seqs=s.max_num_seqs + s.fair_reserve_slots,  # the reserve slots are the engine's too
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
        load_format=s.load_format,
        enable_lora=s.enable_lora,
        max_loras=s.max_loras if s.enable_lora else None,
        max_lora_rank=s.max_lora_rank if s.enable_lora else None,
        max_cpu_loras=s.max_cpu_loras if s.enable_lora else None,
        profile_dir=str(s.profile_dir.resolve()) if s.profile_dir else None,
        extra=dict(s.engine_args),
        process_env=(("VLLM_CPU_OMP_THREADS_BIND", gen_bind),) if gen_bind else (),
        worker_cpu_binds=worker_binds(s, gen_bind),
        worker_env=placement.worker_env(0) if placement else (),
        kv_events_dir=kv_events_dir(names, default_policy, per_model),
    )
    specs = [ModelSpec(names=names, backend="vllm", vllm=engine, root=str(path), **common)]  # type: ignore[arg-type]
    for i, (extra_names, extra) in enumerate(s.extra_models(), 1):
        extra_dir, _ = resolve_model(extra)
        cfg = replace(engine, model=str(extra_dir), served_model_name=extra_names[0], profile_frontend=False,
                      worker_env=placement.worker_env(i) if placement else (),
                      kv_events_dir=kv_events_dir(extra_names, default_policy, per_model))
        specs.append(ModelSpec(names=extra_names, backend="vllm", vllm=cfg, root=str(extra_dir), **common))  # type: ignore[arg-type]
    if s.embedding_enabled:
        # Its own engine: none of the generation models' engine flags (dtype,
        # quantization, --load-format, --engine-arg ...) describe this model.
        emb_arg = None if s.embedding_model == "embedded" else s.embedding_model
        emb_path, emb_name = resolve_model(emb_arg or EMBEDDED_EMBEDDING_NAME)
        emb_names = tuple(s.embedding_served_model_name) or (emb_name,)
        emb = VllmConfig(
            model=str(emb_path),
            served_model_name=emb_names[0],
            runner="pooling",
            max_model_len=None,  # the model's own (256 for all-MiniLM-L6-v2)
            max_num_seqs=min(s.max_num_seqs, 64),
            gpu_memory_utilization=s.embedding_gpu_memory_utilization,
            profile_dir=None,  # profiling is for the generators (the pooling worker hung on stop_profile)
            profile_frontend=False,
            process_env=embedding_env(emb_bind, embedding_busy_loop(s)),
            worker_env=placement.worker_env(len(placement.asks) - 1) if placement else (),
        )
        if emb_bind:
            logger.info("embedding engine: OpenMP threads on cores %s (--embedding-cpu-bind %s)",
                        emb_bind, s.embedding_cpu_bind)
        specs.append(
            ModelSpec(names=emb_names, backend="vllm", vllm=emb, root=str(emb_path), lazy=embedding_lazy(s),
                      **{**common, "num_workers": 1, "slots_per_worker": min(s.max_num_seqs, 64),
                         "reserve_slots": 0})  # type: ignore[arg-type]
        )
    return specs


def kv_events_dir(names: tuple[str, ...], default: str, per_model: Mapping[str, str]) -> str | None:
    """A private folder for the KV event sockets of a model routed by
    `kv-events` (its engines publish there); None for the other policies."""
    policy = next((per_model[n] for n in names if n in per_model), default)
    return tempfile.mkdtemp(prefix="npugw-kv-") if policy == "kv-events" else None


def build_remote_pools(settings: Settings) -> list[tuple[WorkerPool, tuple[str, ...], str]]:
    """One pool per upstream: its slots bound the requests in flight to it.
    A discovering upstream's pool serves no name of its own: its models are
    served as they are listed (server/discovery.py)."""
    from engine_adapter.backends.remote import build_remote_pool

    s = settings
    out: list[tuple[WorkerPool, tuple[str, ...], str]] = []
    for cfg in s.parsed.upstreams:
        pool = build_remote_pool(
            cfg, slots_per_worker=s.max_num_seqs, max_queue_size=s.max_queue_size,
            max_queue_wait=s.max_queue_wait, readiness_interval=s.readiness_interval,
        )
        out.append((pool, () if cfg.discovers else (cfg.name,), ",".join(cfg.urls)))
    return out


def build_served_pools(
    settings: Settings, metrics: EngineMetrics
) -> list[tuple[WorkerPool, tuple[str, ...], str]]:
    device = device_for(settings)
    logger.info("device: %s (backend %s)", device, settings.backend)
    local = [(build_pool(spec, device, metrics), spec.names, spec.root) for spec in model_specs(settings)]
    for pool, _, _ in local:
        pool.passive_readiness = settings.readiness_probe == "passive"
    served = local + build_remote_pools(settings)
    set_routing_policies(settings, served)
    return served


def engine_block_tokens(settings: Settings) -> int:
    """The KV block size (tokens) the engines run with, so that prefix
    routing's blocks are whole engine blocks. vllm-ascend sets 128 whenever
    prefix caching or chunked prefill is on (its refresh_block_size; both are
    on by default), whatever --block-size says; vLLM's CPU platform 128 unless
    --block-size; vLLM's own default 16 elsewhere, and for the simulated
    backend (no KV blocks)."""
    s = settings
    if s.backend == "vllm" and device_for(s) == "npu":
        return 128
    if s.block_size:
        return s.block_size
    return 128 if s.backend == "vllm" and device_for(s) == "cpu" else 16


def set_routing_policies(settings: Settings, served: list[tuple[WorkerPool, tuple[str, ...], str]]) -> None:
    """`--routing-policy`: each pool's choice of worker, each upstream's
    choice of URL (prefix blocks: the KV block size in tokens locally, bytes
    of JSON for upstream nodes)."""
    s = settings
    default, per_model = s.parsed.policies
    opts = PolicyOptions(
        block_tokens=engine_block_tokens(s), block_bytes=s.routing_prefix_block_bytes,
        max_blocks=s.routing_prefix_max_blocks, balance_abs=s.routing_balance_abs_threshold,
        balance_rel=s.routing_balance_rel_threshold,
    )
    for pool, names, _ in served:
        name = next((per_model[n] for n in names or (pool.name,) if n in per_model), default)
        ups = upstreams_of([pool])
        for up in ups:
            up.policy = remote_kv_policy(up.cfg, opts) if name == "kv-events" else make_policy(name, opts, unit="bytes")
        if not ups:
            pool.policy = make_policy(name, opts, sources=local_sources(pool) if name == "kv-events" else None)
        if name != "least-outstanding":
            logger.info("model %s: routing policy %s", pool.name, name)


def canary_policy(settings: Settings) -> CanaryPolicy:
    return CanaryPolicy(
        window=settings.canary_window,
        min_requests=settings.canary_min_requests,
        max_error_rate=settings.canary_max_error_rate,
        max_ttft_p95=settings.canary_max_ttft_p95,
    )


def build_routing(settings: Settings, pools: Mapping[str, ServedPool], metrics: RoutingMetrics) -> RoutingTable:
    """The routing table over the served models (`pools`: served name -> pool)."""
    table = RoutingTable(pools, policy=canary_policy(settings), metrics=metrics)
    table.apply(settings.parsed.routes)
    return table


__all__ = [
    "EMBEDDED_MODEL_NAME", "build_remote_pools", "build_routing", "build_served_pools", "device_for",
    "model_specs",
]
