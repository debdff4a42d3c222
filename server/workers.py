"""`npu-gateway serve --workers N`: N gateway processes on one port.

Only in gateway-only mode (`--model none`): a local engine belongs to one
process (N processes would each start one on the same devices).

Each process binds its own listening socket on HOST:PORT with SO_REUSEPORT,
so the kernel spreads new connections over the processes (by a hash of the
connection's addresses) instead of letting whichever process wakes first
take them. Each runs the whole app: its own upstream connection pools,
health checks, limits and drain. This parent process only supervises:

- SIGTERM/SIGINT go to every process, each of which drains as a single
  gateway does (/ready 503 at once, in-flight requests finish within
  --shutdown-timeout); a second signal makes them exit at once. SIGHUP
  (routing reload) is passed on too.
- A process that exits before it served is a start-up failure: all stop and
  the parent exits with its code. One that dies later is restarted under the
  same index.
- Metrics: PROMETHEUS_MULTIPROC_DIR is set for the processes (a fresh
  temporary folder unless the variable is already set, then that folder,
  emptied first); see server/metrics_multiproc.py.

The processes die with the parent (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from multiprocessing.process import BaseProcess
from types import FrameType

from server.settings import Settings

logger = logging.getLogger("npu_gateway")

RESTART_BACKOFF = 1.0  # seconds before a crashed process is started again


def check_workers(settings: Settings) -> str | None:
    """Why these settings cannot run `workers` processes, or None."""
    if settings.workers <= 1:
        return None
    if settings.model != "none":
        return (
            f"--workers {settings.workers} needs gateway-only mode (--model none, in front of --upstream "
            "nodes): with a local engine every process would start its own engine on the same devices. "
            "For more engine instances use --num-workers; for more gateways with engines, run replicas "
            "behind nginx (deploy/nginx)."
        )
    if settings.port == 0:
        return "--workers > 1 needs a fixed --port (the processes share it)"
    return None


def _reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _port_taken(host: str, port: int) -> OSError | None:
    """SO_REUSEPORT would let the processes join another program's (or an
    old gateway's) listening socket: check the port is free first, without
    the option."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child(settings: Settings, index: int, ready: multiprocessing.connection.Connection) -> None:
    """One gateway process (runs in a fresh interpreter: spawn)."""
    from server.metrics_multiproc import INDEX_ENV

    _die_with_parent()
    os.environ[INDEX_ENV] = str(index)
    # prometheus-client cannot clear a labelled metric in multiprocess mode
    # (routing weights on reload): the old series stay until a restart.
    warnings.filterwarnings("ignore", message="Clearing labels has not been implemented")
    from server.serve import build_server, setup_logging

    setup_logging(settings)
    sock = _reuseport_socket(settings.host, settings.port)
    server = build_server(settings)

    def started() -> None:
        logger.info("gateway process %d (pid %d) serving on %s:%d", index, os.getpid(), settings.host, settings.port)
        ready.send(os.getpid())

    server.on_started = started
    server.same_signal_window = 1.0
    server.run(sockets=[sock])


class _Proc:
    def __init__(self, index: int, process: BaseProcess, ready: multiprocessing.connection.Connection) -> None:
        self.index = index
        self.process = process
        self.ready_conn = ready
        self.served = False


def serve_workers(settings: Settings) -> int:
    """Run `settings.workers` gateway processes until they all exit; the exit
    code (0 after a clean drain)."""
    taken = _port_taken(settings.host, settings.port)
    if taken is not None:
        print(f"npu-gateway: cannot listen on {settings.host}:{settings.port}: {taken}", file=sys.stderr)
        return 1
    from server.metrics_multiproc import ENV, clean_dir, process_gone

    own_dir = ENV not in os.environ or not os.environ[ENV]
    mp_dir = tempfile.mkdtemp(prefix="npu-gateway-metrics-") if own_dir else os.environ[ENV]
    os.makedirs(mp_dir, exist_ok=True)
    clean_dir(mp_dir)
    os.environ[ENV] = mp_dir
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, _Proc] = {}
    stopping = False
    code = 0

    def start(index: int) -> None:
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(settings, index, child_end), name=f"npu-gateway-{index}")
        p.start()
        child_end.close()
        procs[index] = _Proc(index, p, parent_end)

    def forward(sig: int, frame: FrameType | None = None) -> None:
        nonlocal stopping
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for pr in procs.values():
            if pr.process.is_alive() and pr.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pr.process.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        for i in range(settings.workers):
            start(i)
        logger.info("%d gateway processes on %s:%d (SO_REUSEPORT); metrics in %s",
                    settings.workers, settings.host, settings.port, mp_dir)
        while procs:
            waitables: list[object] = [pr.process.sentinel for pr in procs.values()]
            waitables += [pr.ready_conn for pr in procs.values() if not pr.served]
            multiprocessing.connection.wait(waitables, timeout=1.0)  # type: ignore[arg-type]
            for pr in list(procs.values()):
                if not pr.served and pr.ready_conn.poll():
                    with contextlib.suppress(EOFError, OSError):
                        pr.ready_conn.recv()
                        pr.served = True  # (the process logs it)
                if pr.process.is_alive():
                    continue
                pr.process.join()
                exitcode = pr.process.exitcode or 0
                assert pr.process.pid is not None
                process_gone(mp_dir, pr.process.pid)
                pr.ready_conn.close()
                del procs[pr.index]
                if stopping:
                    code = code or (0 if exitcode == 0 else exitcode if exitcode > 0 else 1)
                elif not pr.served:
                    logger.error("gateway process %d exited with %s before serving: stopping", pr.index, exitcode)
                    code = exitcode if exitcode > 0 else 1
                    forward(signal.SIGTERM)
                else:
                    logger.error("gateway process %d exited with %s: restarting it", pr.index, exitcode)
                    time.sleep(RESTART_BACKOFF)
                    if not stopping:
                        start(pr.index)
    finally:
        for pr in procs.values():
            if pr.process.is_alive():
                pr.process.kill()
        if own_dir:
            shutil.rmtree(mp_dir, ignore_errors=True)
    return code
