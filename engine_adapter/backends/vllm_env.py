"""The environment vLLM's engine processes start with (they inherit the
gateway's): offline hub, and OpenMP core binding, KV space and oneDNN's
primitive cache on CPU. Set before the first engine starts;
`engine_process_env` adds one engine's own variables (its devices, its
cores) for its start.

Nothing for the NPU allocator: vllm-ascend sets PYTORCH_NPU_ALLOC_CONF itself
(platform.py), except with sleep mode, whose CaMemAllocator asserts the
variable is absent."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import psutil

T = TypeVar("T")

# oneDNN's process-wide primitive cache (1,024 entries by default). vLLM's CPU
# linear layers keep their own 32 most recent primitives per weight shape,
# so this cache only remembers the ones they dropped: one per batch size and
# shape ever seen. In a soak it filled for hours: the generator's worker
# grew 79 MB of live heap (150 MB anon RSS) in 12 minutes; at 16 entries
# it stayed flat (+0.09 %/h anon RSS) at the same throughput.
ONEDNN_PRIMITIVE_CACHE = "16"


def cpu_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_list(cores: Sequence[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` syntax: '0-7' or '0,2,5'."""
    cores = sorted(cores)
    contiguous = len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1))
    return f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))


def process_defaults(device: str) -> dict[str, str]:
    """The variables every engine process gets unless the gateway's own
    environment sets them (shown by `npu-gateway plan`)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if device == "cpu":
        # Binding to every core nearly doubled throughput over "auto".
        cores = cpu_cores()
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = ONEDNN_PRIMITIVE_CACHE
    return env


def configure_process_env(device: str) -> None:
    """Environment the engine processes inherit; set before the first engine."""
    for key, value in process_defaults(device).items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def engine_process_env(env: Sequence[tuple[str, str]]) -> Iterator[None]:
    """`env` on top of the process environment, restored afterwards. One
    engine's processes inherit it when they are spawned while it is set;
    `start_with_env` sets it for one engine's start at a time."""
    saved = {k: os.environ.get(k) for k, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_STARTING = threading.Lock()  # one engine's environment set at a time


def start_with_env(env: Sequence[tuple[str, str]], start: Callable[[], T], poll: float = 0.05) -> T:
    """`start()` (AsyncLLM's constructor: it spawns the engine's processes
    and waits until they are up, ~20 s on CPU) with `env` set for the
    processes it spawns. `env` and the lock that keeps other starts from
    setting theirs are held only until this start's first process is
    spawned (multiprocessing's spawn: a new child running `spawn_main`, whose
    environment is fixed from then on), or until `start()` ends where it
    spawns none: the engines of a model (--num-workers, --extra-model) then
    load at once instead of one after another."""
    held = contextlib.ExitStack()  # closed once: the environment restored, then the lock released
    once = threading.Lock()
    released = threading.Event()

    def release() -> None:
        with once:
            if not released.is_set():
                released.set()
                held.close()

    held.enter_context(_STARTING)
    try:
        held.enter_context(engine_process_env(env))
        me = psutil.Process()
        before = {p.pid for p in me.children()}  # after the lock: no other start spawns meanwhile
    except BaseException:
        release()
        raise

    def watch() -> None:
        while not released.wait(poll):
            if _spawned_since(me, before):
                release()

    watcher = threading.Thread(target=watch, name="engine-start-env", daemon=True)
    watcher.start()
    try:
        return start()
    finally:
        release()
        watcher.join()


def _spawned_since(me: psutil.Process, before: set[int]) -> bool:
    """A child not in `before` runs multiprocessing's `spawn_main` (it has
    exec'd, so its environment is its own)."""
    for child in me.children():
        if child.pid in before:
            continue
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                return True
        except psutil.Error:  # gone, or not readable yet
            continue
    return False
