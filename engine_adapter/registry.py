"""Build the worker pools the gateway serves from plain specs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.backends.vllm import VllmEngine
from engine_adapter.backends.vllm_config import VllmConfig, planned_card
from engine_adapter.metrics import EngineMetrics
from engine_adapter.pool import WorkerPool
from engine_adapter.types import Engine


@dataclass(frozen=True, slots=True)
class ModelSpec:
    names: tuple[str, ...]  # served names; the first is the model's id
    backend: Literal["vllm", "simulated"] = "vllm"
    vllm: VllmConfig | None = None
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)
    num_workers: int = 1
    slots_per_worker: int = 256
    reserve_slots: int = 0  # per worker, beyond slots_per_worker (--fair-reserve-slots)
    max_queue_size: int = 1024
    max_queue_wait: float = 60.0
    readiness_interval: float = 5.0
    root: str = ""
    lazy: bool = False  # the engines start on the first request (pool.py `ensure_started`)

    @property
    def name(self) -> str:
        return self.names[0]


def build_pool(spec: ModelSpec, device: str, metrics: EngineMetrics | None) -> WorkerPool:
    def factory(index: int) -> Engine:
        if spec.backend == "simulated":
            return SimulatedEngine(spec.simulated, name=spec.root or spec.name)
        if spec.vllm is None:
            raise ValueError(f"model {spec.name!r}: vllm backend without engine config")
        return VllmEngine(spec.vllm, device=device, index=index, metrics=metrics)

    return WorkerPool(
        spec.name,
        factory,
        num_workers=spec.num_workers,
        slots_per_worker=spec.slots_per_worker,
        max_queue_size=spec.max_queue_size,
        max_queue_wait=spec.max_queue_wait,
        readiness_interval=spec.readiness_interval,
        lazy=spec.lazy,
        reserve_slots=spec.reserve_slots,
        planned_card=planned_card(spec.vllm) if spec.lazy and spec.vllm is not None else None,
    )
