"""Fixtures for the e2e tests that put real nginx / Prometheus in front of
real gateway processes.

The nginx and Prometheus start helpers live in tests/deploy
(`deploy_services`, `promql`); that folder is put on sys.path here, as
tests/deploy/conftest.py does for its own tests. A missing nginx /
prometheus / promtool FAILS the tests that need it with an install hint.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import GatewayProcess

DEPLOY_TESTS = Path(__file__).resolve().parents[1] / "deploy"
if str(DEPLOY_TESTS) not in sys.path:
    sys.path.insert(0, str(DEPLOY_TESTS))

import deploy_services  # noqa: E402
from pg_server import PostgresMissing, PostgresServer  # noqa: E402

# Real gateway processes on the simulated engine (the engine behind them is
# not what these tests are about).
SIM_ARGS = ["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim"]


def tool(name: str) -> str:
    try:
        return deploy_services.find_binary(name)
    except deploy_services.BinaryMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def sim_gateways(tmp_path: Path) -> Iterator[Callable[..., list[GatewayProcess]]]:
    """`start(*arg_lists, ready_path="/ready") -> [GatewayProcess, ...]`: one
    simulated-engine gateway per argument list, started in parallel; all
    stopped (SIGTERM, then SIGKILL of the session) at teardown."""
    started: list[GatewayProcess] = []

    def start(*arg_lists: list[str], ready_path: str = "/ready", timeout: float = 90) -> list[GatewayProcess]:
        gws = []
        for args in arg_lists:
            gw = GatewayProcess([*SIM_ARGS, *args], tmp_path / f"gateway-{len(started)}.log")
            started.append(gw)
            gws.append(gw)
        for gw in gws:
            gw.wait_ready(timeout=timeout, path=ready_path)
        return gws

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture
def nginx_server(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """`start(conf_text, name="nginx") -> Popen`: a real nginx on the config's
    own listen port, prefix (pid, logs, temp) under tmp_path/name; stopped
    with SIGQUIT (then SIGKILL) at teardown."""
    nginx = tool("nginx")
    procs: list[subprocess.Popen[bytes]] = []

    def start(conf_text: str, name: str = "nginx") -> subprocess.Popen[bytes]:
        proc = deploy_services.start_nginx(conf_text, tmp_path / name, nginx=nginx, timeout=30)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        deploy_services.stop_process(proc, signal.SIGQUIT)


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], int]]]:
    """`start(config_text, files=None, name="prometheus") -> (Popen, port)`: a
    real Prometheus on 127.0.0.1, TSDB under tmp_path/name; `__PORT__` in the
    config becomes its own port. Stopped with SIGTERM (then SIGKILL)."""
    prometheus = tool("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        config_text: str, files: dict[str, str] | None = None, name: str = "prometheus"
    ) -> tuple[subprocess.Popen[bytes], int]:
        port = deploy_services.free_port()
        proc = deploy_services.start_prometheus(
            config_text.replace("__PORT__", str(port)),
            tmp_path / name,
            port,
            prometheus=prometheus,
            files=files,
            timeout=60,
        )
        procs.append(proc)
        return proc, port

    yield start
    for proc in procs:
        deploy_services.stop_process(proc, signal.SIGTERM)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session's e2e tests (initdb once); each
    test or module makes its own database on it (`new_database`)."""
    try:
        pg = PostgresServer()
    except PostgresMissing as e:
        pytest.fail(str(e), pytrace=False)
    try:
        pg.init()
        yield pg
    finally:
        pg.destroy()
