"""One gateway process's server: the app, its uvicorn server with the drain on
SIGTERM, and the logging set up. `server/cli.py` (one process) and
`server/workers.py` (--workers) both build theirs here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from server.settings import Settings

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
