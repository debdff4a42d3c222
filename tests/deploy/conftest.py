"""Fixtures for the deploy/ tests: paths, external tools, real nginx and
Prometheus servers, and the PromQL metric-name helper.

A missing tool (nginx, prometheus, promtool, kubectl, hadolint) FAILS the
tests that need it with an install hint; nothing is skipped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Make the helper modules beside this file importable (`import promql`,
# `import deploy_services`) whatever pytest's import mode.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import deploy_services  # noqa: E402
import promql  # noqa: E402

REPO = HERE.parent.parent
DEPLOY = REPO / "deploy"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def deploy_dir() -> Path:
    return DEPLOY


def _binary(name: str) -> str:
    try:
        return deploy_services.find_binary(name)
    except deploy_services.BinaryMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def nginx_binary() -> str:
    return _binary("nginx")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _binary("prometheus")


@pytest.fixture(scope="session")
def promtool_binary() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def kubectl_binary() -> str:
    return _binary("kubectl")


@pytest.fixture(scope="session")
def hadolint_binary() -> str:
    return _binary("hadolint")


@pytest.fixture(scope="session")
def shellcheck_binary() -> str:
    return _binary("shellcheck")


@pytest.fixture
def nginx_factory(nginx_binary: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """`start(conf_text, name="nginx") -> Popen`: a real nginx on 127.0.0.1
    (the config's own `listen` port), prefix under tmp_path/name; stopped with
    SIGQUIT (then SIGKILL) at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(conf_text: str, name: str = "nginx") -> subprocess.Popen[bytes]:
        proc = deploy_services.start_nginx(conf_text, tmp_path / name, nginx=nginx_binary)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        deploy_services.stop_process(proc, signal.SIGQUIT)


@pytest.fixture
def prometheus_factory(
    prometheus_binary: str, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], int]]]:
    """`start(config_text, files=None, name="prometheus") -> (Popen, port)`:
    a real Prometheus on 127.0.0.1 with its TSDB under tmp_path/name; stopped
    with SIGTERM (then SIGKILL) at teardown. `__PORT__` in the config text
    becomes the port it listens on (to let it scrape itself)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        config_text: str, files: dict[str, str] | None = None, name: str = "prometheus"
    ) -> tuple[subprocess.Popen[bytes], int]:
        port = deploy_services.free_port()
        proc = deploy_services.start_prometheus(
            config_text.replace("__PORT__", str(port)), tmp_path / name, port, prometheus=prometheus_binary, files=files
        )
        procs.append(proc)
        return proc, port

    yield start
    for proc in procs:
        deploy_services.stop_process(proc, signal.SIGTERM)


@pytest.fixture(scope="session")
def metric_names_in_promql() -> Callable[[str], set[str]]:
    """The `promql.metric_names_in_promql` helper, as a fixture."""
    return promql.metric_names_in_promql
