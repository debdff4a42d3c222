"""`npu-gateway plan [serve's flags]`: each engine serve would start, its
model, devices, memory fraction and environment, without starting any (no
torch_npu, no model preparation: npu-smi is enough). Exit 0 when it fits,
2 with the reason when it does not (as serve refuses at start)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from engine_adapter.backends.vllm_env import process_defaults
from engine_adapter.devices.listing import DeviceListError
from engine_adapter.placement import VISIBLE_ENV, PlacementError
from server.models_setup import cpu_binds, device_for, embedding_busy_loop, embedding_env, worker_binds
from server.placement import Placement, engine_asks, engine_placement
from server.settings import Settings


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [_row(r, widths) for r in rows]


def _where(settings: Settings, index: int, n_asks: int) -> str:
    s = settings
    if index == 0:
        return s.model or "embedded"
    if s.embedding_enabled and index == n_asks - 1:
        return s.embedding_model or "embedded"
    return s.extra_models()[index - 1][1]


def _env_text(env: Sequence[tuple[str, str]]) -> str:
    return " ".join(f"{k}={v}" for k, v in env) or "-"


def _placed_rows(settings: Settings, placement: Placement) -> list[list[str]]:
    rows = [["ENGINE", "MODEL", "DEVICES", "MEMORY", "ENVIRONMENT"]]
    n = len(placement.asks)
    for i, group in enumerate(placement.places):
        for p in group:
            extra = embedding_env(None, embedding_busy_loop(settings)) if placement.asks[i].embedding else ()
            devices = p.names + (" (shared)" if p.shared else "")
            rows.append([f"{p.model}/{p.index}", _where(settings, i, n), devices, f"{p.memory_fraction:.2f}",
                         _env_text((*p.env, *extra))])
    return rows


def _cpu_rows(settings: Settings, device: str) -> list[list[str]]:
    s = settings
    rows = [["ENGINE", "MODEL", "DEVICES", "MEMORY", "ENVIRONMENT"]]
    asks = engine_asks(s)
    on_cpu = device == "cpu" and s.backend == "vllm"
    gen_bind, emb_bind = cpu_binds(s) if on_cpu and s.embedding_enabled else (None, None)
    binds = worker_binds(s, gen_bind) if on_cpu else ()
    where = "simulated" if s.backend == "simulated" else device
    for i, ask in enumerate(asks):
        for w in range(ask.workers):
            if ask.embedding:
                env = embedding_env(emb_bind, embedding_busy_loop(s)) if on_cpu else ()
            elif binds:
                env = (("VLLM_CPU_OMP_THREADS_BIND", binds[w % len(binds)]),)
            else:
                env = (("VLLM_CPU_OMP_THREADS_BIND", gen_bind),) if gen_bind else ()
            fraction = "-" if device == "cpu" or s.backend == "simulated" else f"{ask.memory_fraction:.2f}"
            rows.append([f"{ask.model}/{w}", _where(s, i, len(asks)), where, fraction, _env_text(env)])
    return rows


def run_plan(settings: Settings, out: TextIO, err: TextIO, *, npu_smi_output: Path | None = None) -> int:
    """Print the plan to `out`; 0 when it fits, 2 (reason on `err`) when not."""
    s = settings
    if s.gateway_only:
        print("--model none: no local engine (the gateway fronts its --upstream nodes only)", file=out)
        return 0
    if npu_smi_output is not None and s.device == "auto":
        s = s.model_copy(update={"device": "npu"})  # a recorded npu-smi output: plan for its NPUs
    device = device_for(s)
    try:
        placement = engine_placement(s, device, npu_smi_output=npu_smi_output)
    except DeviceListError as e:
        print(f"npu-gateway plan: cannot list the devices: {e}", file=err)
        return 2
    except PlacementError as e:
        print(f"npu-gateway plan: the engines do not fit: {e}", file=err)
        return 2
    if placement is None:
        why = "Ray places the workers" if s.distributed_executor_backend == "ray" and device != "cpu" else "no devices"
        print(f"device: {device} (backend {s.backend}; {why})", file=out)
        rows = _cpu_rows(s, device)
    else:
        listed = ",".join(d.name for d in placement.listed)
        usable = ",".join(d.name for d in placement.usable)
        print(f"device: {device}; listed by {placement.source}: {listed}; the engines may use: {usable}", file=out)
        rows = _placed_rows(s, placement)
    for line in _table(rows):
        print(line, file=out)
    if placement is not None:
        free = ",".join(d.name for d in placement.free) or "none"
        print(f"devices no engine uses: {free}", file=out)
        var = VISIBLE_ENV[device]
        print(f"{var} holds logical ids: a device's position in the list npu-smi / nvidia-smi prints", file=out)
    defaults = process_defaults(device if device in ("cpu", "npu", "cuda") else "cpu")
    print(f"every engine also gets (unless already set): {_env_text(sorted(defaults.items()))}", file=out)
    return 0


__all__ = ["run_plan"]
