"""Settings -> which devices each engine gets (engine_adapter/placement.py):
used at start-up, before any engine starts, and by `npu-gateway plan`.

Needs npu-smi (or nvidia-smi) only: no torch, no torch_npu, no NPU context."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine_adapter.devices.listing import (
    Device,
    DeviceListError,
    list_gpus,
    list_npus,
    visible_subset,
)
from engine_adapter.model import EMBEDDED_EMBEDDING_NAME, EMBEDDED_MODEL_NAME
from engine_adapter.placement import (
    VISIBLE_ENV,
    EngineAsk,
    EnginePlace,
    PlacementError,
    free_devices,
    place_engines,
    select_devices,
)
from server.settings import Settings

logger = logging.getLogger(__name__)

__all__ = ["DeviceListError", "Placement", "PlacementError", "engine_asks", "engine_placement", "placed_kind"]


@dataclass(frozen=True, slots=True)
class Placement:
    kind: str  # "npu" or "cuda"
    listed: tuple[Device, ...]  # what npu-smi / nvidia-smi lists
    usable: tuple[Device, ...]  # what --devices (or *_VISIBLE_DEVICES) leaves of it
    asks: tuple[EngineAsk, ...]
    places: tuple[tuple[EnginePlace, ...], ...]  # one tuple per ask
    source: str  # where the device list came from

    @property
    def free(self) -> list[Device]:
        return free_devices(self.usable, self.places)

    def worker_env(self, ask: int) -> tuple[tuple[tuple[str, str], ...], ...]:
        return tuple(p.env for p in self.places[ask])


def _label(served: list[str], model: str | None, default: str) -> str:
    if served:
        return served[0]
    if model in (None, "", "embedded", "embedded-embedding"):
        return default
    return Path(model).name or default


def engine_asks(settings: Settings) -> list[EngineAsk]:
    """What each model's engines need, in the order model_specs builds them:
    --model, each --extra-model, the embedding engine."""
    s = settings
    tp, pp = s.tensor_parallel_size, s.pipeline_parallel_size
    asks = [EngineAsk(_label(s.served_model_name, s.model, EMBEDDED_MODEL_NAME), s.num_workers, tp, pp,
                      s.gpu_memory_utilization)]
    for (names, _), own in zip(s.extra_models(), s.extra_model_devices(), strict=True):
        asks.append(EngineAsk(names[0], s.num_workers, tp, pp, s.gpu_memory_utilization, own))
    if s.embedding_enabled:
        emb = s.embedding_model if s.embedding_model != "embedded" else None
        asks.append(EngineAsk(_label(s.embedding_served_model_name, emb, EMBEDDED_EMBEDDING_NAME),
                              memory_fraction=s.embedding_gpu_memory_utilization, embedding=True))
    return asks


def placed_kind(settings: Settings, device: str) -> bool:
    """Whether the engines of these settings are placed on devices: vLLM
    engines on an NPU or a GPU, unless Ray places the workers itself."""
    s = settings
    return (
        device in VISIBLE_ENV and s.backend == "vllm" and not s.gateway_only
        and s.distributed_executor_backend != "ray"
    )


def _listed(settings: Settings, kind: str, npu_smi_output: Path | None) -> tuple[list[Device], str]:
    if kind == "cuda":
        return list_gpus(), "nvidia-smi"
    if npu_smi_output is not None:
        return list_npus(output_file=npu_smi_output), f"npu-smi output in {npu_smi_output}"
    if shutil.which("npu-smi") is None:
        if settings.devices and all(d.isdigit() for d in settings.devices):
            logger.warning("npu-smi is not on PATH: --devices %s taken as they are (not checked)",
                           ",".join(settings.devices))
            return [Device(d, int(d)) for d in settings.devices], "--devices (npu-smi not found, unchecked)"
        raise DeviceListError(
            "`npu-smi info`: npu-smi not found on PATH, so the NPUs cannot be listed; mount it into the "
            "container (-v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi) or give --devices 0,1,..."
        )
    return list_npus(), "npu-smi info"


def engine_placement(
    settings: Settings,
    device: str,
    *,
    npu_smi_output: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Placement | None:
    """Where each engine goes, or None where nothing is placed (CPU, the
    simulated backend, --model none, Ray). Raises DeviceListError when the
    devices cannot be listed, PlacementError when the engines do not fit."""
    if not placed_kind(settings, device):
        return None
    env = os.environ if environ is None else environ
    listed, source = _listed(settings, device, npu_smi_output)
    visible = visible_subset(listed, VISIBLE_ENV[device], env) if not settings.devices else listed
    usable = select_devices(visible, settings.devices or None)
    asks = engine_asks(settings)
    places = place_engines(asks, usable, device)
    return Placement(device, tuple(listed), tuple(usable), tuple(asks), tuple(tuple(p) for p in places), source)


def log_placement(placement: Placement) -> None:
    for group in placement.places:
        for p in group:
            logger.info(
                "engine placement: %s engine %d on %s %s (%s, memory fraction %.2f%s)",
                p.model, p.index, placement.kind.upper(), p.names, " ".join(f"{k}={v}" for k, v in p.env),
                p.memory_fraction, ", shared with a generation engine" if p.shared else "",
            )
    if placement.free:
        logger.info("devices no engine uses: %s", ",".join(d.name for d in placement.free))
