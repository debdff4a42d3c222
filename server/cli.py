"""`npu-gateway serve`, `npu-gateway plan` and `npu-gateway prepare-model`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from server.settings import Settings
from server.settings_cli import add_settings_arguments, settings_from_args

logger = logging.getLogger("npu_gateway")


class GatewayServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting work (503 + Retry-After, /ready fails at
    once) while the socket stays open, let in-flight requests finish for up to
    --shutdown-timeout, abort the rest with clean errors, then exit 0. A
    second signal exits at once."""

    def __init__(self, config: uvicorn.Config, settings: Settings) -> None:
        super().__init__(config)
        self.settings = settings
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_started: Callable[[], None] | None = None  # --workers: tells the supervisor
        # --workers: a signal can arrive twice (from the terminal or systemd's
        # cgroup kill, and forwarded by the supervisor): the second within
        # this many seconds is the same signal, not "exit at once".
        self.same_signal_window = 0.0
        self._drain_since = 0.0

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.started and self.on_started is not None:
            self.on_started()
        elif self.started:  # uvicorn says where it listens only for sockets it bound itself
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    logger.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except in a --workers process that drained: there the
        signals are ignored from the end of the drain until it exits, and
        none is re-raised. A process-group SIGTERM reaches such a process
        twice (directly and forwarded by the supervisor); a copy that came
        late, or after uvicorn restored the default handlers, killed a
        process that had finished every stream (exit -15: the supervisor
        then exited 1)."""
        if not self.same_signal_window:
            with super().capture_signals():
                yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, signal.SIG_IGN if self._draining else handler)
        if not self._draining:
            for captured in reversed(self._captured_signals):
                signal.raise_signal(captured)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining and time.monotonic() - self._drain_since < self.same_signal_window:
            return
        if self._draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._drain_since = time.monotonic()
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        app = self.config.loaded_app
        gw = getattr(getattr(_unwrap(app), "state", None), "gateway", None)
        timeout = self.settings.shutdown_timeout
        if gw is not None:
            logger.info("draining: in-flight requests get up to %.0fs", timeout)
            gw.begin_drain()
            await gw.wait_idle(timeout)
            await asyncio.gather(*(p.stop(0) for p in gw.pools), return_exceptions=True)
            await asyncio.sleep(0.2)  # let aborted streams write their error events
        self.should_exit = True


def _unwrap(app: object) -> object:
    while hasattr(app, "app") and not hasattr(app, "state"):
        app = app.app
    return app


def setup_logging(settings: Settings) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def build_server(settings: Settings) -> GatewayServer:
    """The app and its server (one per gateway process)."""
    from server.app import create_app
    from server.auth import KeysFileError

    try:
        app = create_app(settings)
    except KeysFileError as e:
        print(f"npu-gateway: invalid keys file: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
    )
    return GatewayServer(config, settings)


def serve(settings: Settings) -> None:
    setup_logging(settings)
    if settings.workers > 1:  # several processes, gateway-only: server/workers.py
        from server.workers import check_workers, serve_workers

        problem = check_workers(settings)
        if problem is not None:
            print(f"npu-gateway: {problem}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(serve_workers(settings))
    check_placement(settings)  # engines that do not fit the devices: exit 2 before anything starts
    server = build_server(settings)  # settings and keys are checked first (exit 2)
    sock = listening_socket(settings.host, settings.port)  # then the port, before the engines start
    server.run(sockets=[sock])


def check_placement(settings: Settings) -> None:
    """Refuse at start (exit 2), before any engine starts or any model is
    prepared, when the engines do not fit the devices (server/placement.py)."""
    from server.models_setup import device_for
    from server.placement import DeviceListError, PlacementError, engine_placement

    try:
        engine_placement(settings, device_for(settings))
    except (DeviceListError, PlacementError) as e:
        print(f"npu-gateway: cannot place the engines: {e} (`npu-gateway plan` with the same flags shows "
              "the devices)", file=sys.stderr)
        raise SystemExit(2) from None


def listening_socket(host: str, port: int) -> socket.socket:
    """HOST:PORT, bound before the app starts its engines (as vLLM's own
    server does): a port another program holds fails in a second
    with a clear message, not after minutes of loading weights; and no
    outgoing connection made meanwhile (the engines' own, health checks) can
    take it as its ephemeral local port, which failed a gateway start in CI
    after its engines were up. uvicorn starts listening once the app has
    started; until then connections are refused, as before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"npu-gateway: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(1) from None
    return sock  # not inheritable: engine processes started by spawn never hold it


def prepare_model() -> None:
    from engine_adapter.model import embedded_embedding_dir, prepare_embedded_model

    print(prepare_embedded_model(progress=True))
    print(embedded_embedding_dir())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="npu-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve the OpenAI-compatible API", usage="npu-gateway serve [options]")
    add_settings_arguments(serve_p)
    plan_p = sub.add_parser(
        "plan", help="print each engine serve would start: model, devices, memory fraction, environment "
        "(starts nothing; exit 2 when the engines do not fit)",
    )
    add_settings_arguments(plan_p)
    plan_p.add_argument(
        "--npu-smi-output", type=Path, default=None, metavar="FILE",
        help="read the NPUs from this recorded `npu-smi info` output instead of running npu-smi "
        "(e.g. on a login node); implies --device npu unless --device is given",
    )
    sub.add_parser("prepare-model", help="convert the embedded model once (no network)")
    from server.usage import cli as usage_cli

    usage_cli.add_arguments(sub.add_parser("usage", help="the usage ledger's report (as GET /admin/usage)"))
    ns = parser.parse_args(argv)
    if ns.command == "prepare-model":
        prepare_model()
        return
    if ns.command == "usage":
        raise SystemExit(usage_cli.run(ns))
    try:
        settings = settings_from_args(ns)
    except Exception as e:  # pydantic ValidationError: a clear message, no trace
        print(f"npu-gateway: invalid settings:\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    if ns.command == "plan":
        from server.plan import run_plan

        raise SystemExit(run_plan(settings, sys.stdout, sys.stderr, npu_smi_output=ns.npu_smi_output))
    serve(settings)


if __name__ == "__main__":
    main()


