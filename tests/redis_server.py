"""A real redis-server for tests (Debian has no valkey-server; Redis 7 speaks
the same protocol): on 127.0.0.1 on a free port, no persistence, its files in
a temporary folder. `stop()` kills it (SIGKILL: the store lost), `start()`
brings it back on the same port (empty). scripts/test-services.sh installs
the package."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from support import free_port, wait_until_sync


class RedisMissing(RuntimeError):
    pass


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise RedisMissing("redis-server not found: install it (bash scripts/test-services.sh, "
                               "or apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="npugw-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.folder / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_until_sync(answers, timeout, what=lambda: f"redis-server on :{self.port} to answer PING")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
