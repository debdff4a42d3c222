"""A pool's generation engines on disjoint CPU cores (`--worker-cpu-bind`):
each worker's VLLM_CPU_OMP_THREADS_BIND is its own share of the
generators' cores."""

from __future__ import annotations

import pytest

from engine_adapter.backends.vllm_config import CPU_BIND_ENV, VllmConfig
from server.models_setup import parse_cpu_list, worker_binds
from server.settings import Settings


@pytest.fixture(autouse=True)
def _no_user_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)


def settings(**kw: object) -> Settings:
    return Settings(device="cpu", **kw)  # type: ignore[call-arg]


def test_each_worker_gets_its_own_share_of_the_cores() -> None:
    assert worker_binds(settings(num_workers=2), None, cores=[0, 1]) == ("0", "1")
    assert worker_binds(settings(num_workers=2), None, cores=list(range(8))) == ("0-3", "4-7")
    assert worker_binds(settings(num_workers=3), None, cores=list(range(8))) == ("0-2", "3-5", "6-7")
    assert worker_binds(settings(num_workers=2), None, cores=[0, 2, 5, 7]) == ("0,2", "5,7")
    # with 16+ cores the embedding engine's core is out of the generators' set
    assert worker_binds(settings(num_workers=2), "0-14", cores=list(range(16))) == ("0-7", "8-14")


def test_no_split_when_it_cannot_or_should_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_binds(settings(), None, cores=[0, 1]) == ()  # one worker: every core
    assert worker_binds(settings(num_workers=3), None, cores=[0, 1]) == ()  # fewer cores than workers
    assert worker_binds(settings(num_workers=2, worker_cpu_bind="shared"), None, cores=[0, 1]) == ()
    assert worker_binds(Settings(device="npu", num_workers=2), None, cores=[0, 1]) == ()  # type: ignore[call-arg]
    monkeypatch.setenv(CPU_BIND_ENV, "0-1")  # the user's choice stands
    assert worker_binds(settings(num_workers=2), None, cores=[0, 1]) == ()


def test_an_engine_starts_with_its_workers_share() -> None:
    cfg = VllmConfig(model="m", served_model_name="m", process_env=((CPU_BIND_ENV, "0-14"), ("X", "1")), worker_cpu_binds=("0-7", "8-14"))
    assert dict(cfg.env_for(0)) == {CPU_BIND_ENV: "0-7", "X": "1"}
    assert dict(cfg.env_for(1)) == {CPU_BIND_ENV: "8-14", "X": "1"}
    assert VllmConfig(model="m", served_model_name="m", process_env=(("X", "1"),)).env_for(1) == (("X", "1"),)
    assert CPU_BIND_ENV not in cfg.engine_kwargs("cpu") and "worker_cpu_binds" not in cfg.engine_kwargs("cpu")


def test_the_settings_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.models_setup import model_specs

    monkeypatch.setattr("server.models_setup.cpu_cores", lambda: [0, 1])
    gen = model_specs(settings(num_workers=2))[0].vllm  # the embedding engine on too (one thread on core 1)
    assert gen is not None and gen.worker_cpu_binds == ("0", "1")
    one = model_specs(settings(embedding_model="none"))[0].vllm
    assert one is not None and one.worker_cpu_binds == ()
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]


def test_the_front_end_is_profiled_off_cpu_only() -> None:
    cfg = VllmConfig(model="m", served_model_name="m", profile_dir="/tmp/p")
    assert cfg.engine_kwargs("cpu", 0)["profiler_config"]["ignore_frontend"] is True
    assert cfg.engine_kwargs("npu", 0)["profiler_config"]["ignore_frontend"] is False
    assert cfg.engine_kwargs("npu", 1)["profiler_config"]["ignore_frontend"] is True  # engine 0's only
