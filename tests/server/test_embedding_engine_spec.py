"""The embedding engine's CPU cores and device memory share (issue 15)."""

from __future__ import annotations

import pytest

from server.models_setup import cpu_binds
from server.settings import Settings


@pytest.fixture(autouse=True)
def _no_user_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)


def settings(**kw: object) -> Settings:
    return Settings(device="cpu", **kw)  # type: ignore[call-arg]


def test_auto_gives_the_embedding_engine_one_thread_on_the_last_core() -> None:
    assert cpu_binds(settings(), cores=[0, 1]) == (None, "1")
    assert cpu_binds(settings(), cores=[0, 2, 5]) == (None, "5")


def test_auto_takes_its_core_out_of_the_generators_set_on_big_boxes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_binds(settings(), cores=list(range(16))) == ("0-14", "15")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")  # the user's choice stands
    assert cpu_binds(settings(), cores=list(range(16))) == (None, "15")


def test_shared_and_explicit_binds() -> None:
    assert cpu_binds(settings(embedding_cpu_bind="shared"), cores=[0, 1]) == (None, None)
    assert cpu_binds(settings(embedding_cpu_bind="6-7"), cores=list(range(8))) == (None, "6-7")


def test_no_cpu_binding_on_accelerators() -> None:
    s = Settings(device="npu")  # type: ignore[call-arg]
    assert cpu_binds(s, cores=[0, 1]) == (None, None)
    assert s.embedding_gpu_memory_utilization == 0.05
