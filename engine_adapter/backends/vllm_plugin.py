"""A vLLM general plugin (entry point `vllm.general_plugins`): vLLM loads it
in every engine-core and worker process it starts. It acts only on the
variables the gateway sets for its own engines, so a `vllm serve` run from
the same environment is untouched.

`NPUGW_SHM_BUSY_LOOP_S`: how long a reader of vLLM's shared-memory queues
(the worker waiting for the next step, the engine core waiting for the
worker's output) spins with `sched_yield()` after its last read before it
sleeps on a socket (vLLM's `SpinCondition`, 1 s). On a CPU engine that
spin runs on the cores the model computes on.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

BUSY_LOOP_ENV = "NPUGW_SHM_BUSY_LOOP_S"


def set_shm_busy_loop(seconds: float) -> bool:
    """Make `seconds` the default spin of every queue reader created from now
    on in this process. False where this vLLM has no `SpinCondition`."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    spin = getattr(shm_broadcast, "SpinCondition", None)
    init = getattr(spin, "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    if not defaults or len(defaults) != 1 or not isinstance(defaults[0], (int, float)):
        return False
    init.__defaults__ = (seconds,)  # type: ignore[union-attr]
    return True


def register() -> None:
    value = os.environ.get(BUSY_LOOP_ENV)
    if not value:
        return
    try:
        seconds = max(0.0, float(value))
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; vLLM's default stays", BUSY_LOOP_ENV, value)
        return
    if not set_shm_busy_loop(seconds):
        logger.warning("%s: this vLLM has no SpinCondition to set; ignored", BUSY_LOOP_ENV)
