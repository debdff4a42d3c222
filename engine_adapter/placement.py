"""Which devices each engine runs on (NPU and GPU).

Every generation engine (each of a model's `--num-workers`, each
`--extra-model`) gets its own contiguous group of tensor-parallel x
pipeline-parallel devices, handed to its processes as
`ASCEND_RT_VISIBLE_DEVICES` (NPU) or `CUDA_VISIBLE_DEVICES` (GPU) before they
start. Models with their own `devices` are placed first, then the others in
order, each group the first run of free adjacent devices. The embedding
engine (one device) takes a free device when one is left, else shares the
generator device with the lowest memory fraction, when the fractions on it
stay <= SHARED_MEMORY_LIMIT. What does not fit raises PlacementError naming
what is needed and what is free; nothing is started here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_adapter.devices.listing import GPU_VISIBLE_ENV, NPU_VISIBLE_ENV, Device

# The memory fractions of the engines on one device add up to at most this:
# the rest is for each process's device context and the runtime's workspace.
SHARED_MEMORY_LIMIT = 0.95

VISIBLE_ENV = {"npu": NPU_VISIBLE_ENV, "cuda": GPU_VISIBLE_ENV}


class PlacementError(ValueError):
    """The engines do not fit the devices (or the devices given are wrong)."""


@dataclass(frozen=True, slots=True)
class EngineAsk:
    """What one model's engines need."""

    model: str
    workers: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    memory_fraction: float = 0.9
    devices: tuple[str, ...] | None = None  # the model's own devices (`;devices=`), generators only
    embedding: bool = False  # one device, which it may share

    @property
    def group(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def needed(self) -> int:
        return self.workers * self.group


@dataclass(frozen=True, slots=True)
class EnginePlace:
    """Where one engine runs."""

    model: str
    index: int  # the worker's index in its model's pool
    devices: tuple[Device, ...]
    memory_fraction: float
    env: tuple[tuple[str, str], ...]
    shared: bool = False  # on a device a generation engine also uses

    @property
    def names(self) -> str:
        return ",".join(d.name for d in self.devices)


def select_devices(
    listed: Sequence[Device], wanted: Sequence[str] | None, what: str = "--devices", among: str = "the host lists"
) -> list[Device]:
    """`wanted` (names, as npu-smi prints them) out of `listed`, in the order
    given; all of `listed` when None. Unknown names and duplicates are refused."""
    if not wanted:
        return list(listed)
    by_name = {d.name: d for d in listed}
    seen: set[str] = set()
    out: list[Device] = []
    for name in wanted:
        if name in seen:
            raise PlacementError(f"{what}: device {name} is given twice")
        if name not in by_name:
            raise PlacementError(
                f"{what}: device {name} is not one {among} ({', '.join(by_name) or 'none'})"
            )
        seen.add(name)
        out.append(by_name[name])
    return out


def _env(kind: str, devices: Sequence[Device]) -> tuple[tuple[str, str], ...]:
    ids = ",".join(str(d.index) for d in devices)
    if kind == "cuda":  # nvidia-smi's order, not CUDA's fastest-first
        return ((GPU_VISIBLE_ENV, ids), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
    return ((VISIBLE_ENV[kind], ids),)


def _names(devices: Sequence[Device]) -> str:
    return ",".join(d.name for d in devices) or "none"


def _take_run(free: list[Device], order: dict[str, int], size: int) -> list[Device] | None:
    """The first `size` free devices adjacent in `order` (the device list)."""
    ranked = sorted(free, key=lambda d: order[d.name])
    for start in range(len(ranked) - size + 1):
        run = ranked[start:start + size]
        if order[run[-1].name] - order[run[0].name] == size - 1:
            return run
    return None


def _need_text(asks: Sequence[EngineAsk]) -> str:
    parts = [
        f"{a.model}: {a.workers} x {a.group} (tensor-parallel {a.tensor_parallel} x pipeline-parallel "
        f"{a.pipeline_parallel})" for a in asks if not a.embedding
    ]
    return "; ".join(parts)


def place_engines(asks: Sequence[EngineAsk], devices: Sequence[Device], kind: str) -> list[list[EnginePlace]]:
    """One list of placements per ask, in the order of `asks`."""
    if kind not in VISIBLE_ENV:
        raise ValueError(f"no device placement on {kind!r}")
    order = {d.name: i for i, d in enumerate(devices)}
    free = list(devices)
    out: list[list[EnginePlace]] = [[] for _ in asks]
    load: dict[str, float] = {}  # device name -> memory fractions placed on it
    gens = [a for a in asks if not a.embedding]
    total = sum(a.needed for a in gens)
    if total > len(devices):
        raise PlacementError(
            f"the engines need {total} devices ({_need_text(gens)}) and {len(devices)} are available "
            f"({_names(devices)}); lower --num-workers or --tensor-parallel-size, drop an --extra-model, "
            "or give more devices"
        )
    # Models with their own devices first, so that the others fill around them.
    ranked = sorted(range(len(asks)), key=lambda i: (asks[i].embedding, asks[i].devices is None))
    for i in ranked:
        ask = asks[i]
        if ask.embedding:
            continue
        pool = free
        if ask.devices is not None:
            own = select_devices(devices, ask.devices, f"{ask.model} devices=", "the engines may use")
            taken = [d.name for d in own if d not in free]
            if taken:
                raise PlacementError(f"{ask.model} devices={','.join(ask.devices)}: device "
                                     f"{','.join(taken)} is already another model's")
            if len(own) % ask.group:
                raise PlacementError(
                    f"{ask.model} devices={','.join(ask.devices)}: tensor-parallel {ask.tensor_parallel} x "
                    f"pipeline-parallel {ask.pipeline_parallel} = {ask.group} does not divide its {len(own)} devices"
                )
            if len(own) != ask.needed:
                raise PlacementError(
                    f"{ask.model} devices={','.join(ask.devices)}: its {ask.workers} engine(s) of {ask.group} "
                    f"device(s) need {ask.needed} devices, {len(own)} are given"
                )
            pool = own
        for w in range(ask.workers):
            run = _take_run(pool, order, ask.group)
            if run is None:
                raise PlacementError(
                    f"{ask.model} engine {w} needs {ask.group} adjacent free device(s); free: {_names(pool)} "
                    f"(devices: {_names(devices)}; {_need_text(gens)})"
                )
            for d in run:
                pool.remove(d)
                if pool is not free:
                    free.remove(d)
                load[d.name] = load.get(d.name, 0.0) + ask.memory_fraction
            out[i].append(EnginePlace(ask.model, w, tuple(run), ask.memory_fraction, _env(kind, run)))
    for i, ask in enumerate(asks):
        if ask.embedding:
            out[i] = [_place_embedding(ask, devices, free, load, kind)]
    return out


def _place_embedding(
    ask: EngineAsk, devices: Sequence[Device], free: list[Device], load: dict[str, float], kind: str
) -> EnginePlace:
    if free:
        dev = free[0]
    elif load:
        dev = min((d for d in devices if d.name in load), key=lambda d: load[d.name])  # the first on a tie
    else:
        raise PlacementError(f"{ask.model}: no device to run on (devices: {_names(devices)})")
    shared = dev.name in load
    if dev in free:
        free.remove(dev)
    total = load.get(dev.name, 0.0) + ask.memory_fraction
    if shared and total > SHARED_MEMORY_LIMIT + 1e-9:
        raise PlacementError(
            f"the embedding engine {ask.model} has no device of its own (devices: {_names(devices)}, all "
            f"taken by the generation engines) and sharing device {dev.name} would put "
            f"{load[dev.name]:.2f} + {ask.memory_fraction:.2f} = {total:.2f} of its memory in use, over "
            f"{SHARED_MEMORY_LIMIT}; lower --gpu-memory-utilization or --embedding-gpu-memory-utilization, "
            "give one more device, or --embedding-model none"
        )
    load[dev.name] = total
    return EnginePlace(ask.model, 0, (dev,), ask.memory_fraction, _env(kind, [dev]), shared=shared)


def free_devices(devices: Sequence[Device], placed: Sequence[Sequence[EnginePlace]]) -> list[Device]:
    used = {d.name for group in placed for p in group for d in p.devices}
    return [d for d in devices if d.name not in used]
