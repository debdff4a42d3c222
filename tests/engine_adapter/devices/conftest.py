"""Shared helpers for the device-probe tests: recorded npu-smi outputs and tiny scripts."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "npu-smi"


@pytest.fixture
def fixture_dir() -> Path:
    return FIXTURES


@pytest.fixture
def load_fixture() -> Callable[[str], str]:
    """Text of one recorded npu-smi output from tests/fixtures/npu-smi."""

    def load(name: str) -> str:
        return (FIXTURES / name).read_text(encoding="utf-8")

    return load


@pytest.fixture
def make_script(tmp_path: Path) -> Callable[[str], Path]:
    """Write an executable /bin/sh script with the given body and return its path."""
    counter = iter(range(1000))

    def make(body: str) -> Path:
        path = tmp_path / f"fake-npu-smi-{next(counter)}"
        path.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
        path.chmod(0o755)
        return path

    return make


@pytest.fixture
def cat_fixture_script(make_script: Callable[[str], Path]) -> Callable[[str], Path]:
    """A fake npu-smi that prints one recorded fixture file."""

    def make(name: str) -> Path:
        return make_script(f"exec cat {shlex.quote(str(FIXTURES / name))}")

    return make
