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


def test_embedding_busy_loop_goes_to_the_embedding_engine_only() -> None:
    from engine_adapter.backends.vllm_plugin import BUSY_LOOP_ENV
    from server.models_setup import embedding_busy_loop, embedding_env, model_specs

    assert embedding_env("1", None) == (("VLLM_CPU_OMP_THREADS_BIND", "1"),)
    assert embedding_env(None, 0.05) == ((BUSY_LOOP_ENV, "0.05"),)
    specs = model_specs(settings(embedding_busy_loop=0.05))
    gen, emb = specs[0].vllm, specs[-1].vllm
    assert gen is not None and emb is not None and emb.runner == "pooling"
    assert dict(emb.process_env)[BUSY_LOOP_ENV] == "0.05"
    assert BUSY_LOOP_ENV not in dict(gen.process_env)
    cpu_default = model_specs(settings())[-1].vllm  # unset on CPU: a short spin
    assert cpu_default is not None and dict(cpu_default.process_env)[BUSY_LOOP_ENV] == "0.05"
    assert embedding_busy_loop(Settings(device="npu")) is None  # type: ignore[call-arg]  # vLLM's own
    assert embedding_busy_loop(settings(embedding_busy_loop=1)) == 1.0
    with pytest.raises(ValueError):
        settings(embedding_busy_loop=-1)


def test_the_embedding_engine_starts_on_first_use_on_cpu_by_default() -> None:
    from engine_adapter.backends.vllm_config import planned_card
    from engine_adapter.registry import build_pool
    from server.models_setup import embedding_lazy, model_specs

    assert embedding_lazy(settings())  # auto on CPU
    assert not embedding_lazy(Settings(device="npu"))  # type: ignore[call-arg]  # its device memory: at start
    assert not embedding_lazy(settings(embedding_start="eager"))
    assert embedding_lazy(Settings(device="npu", embedding_start="lazy"))  # type: ignore[call-arg]
    specs = model_specs(settings())
    assert [s.lazy for s in specs] == [False, True]  # the generator starts with the gateway
    emb = specs[-1].vllm
    assert emb is not None
    card = planned_card(emb)  # what /v1/models lists until it starts: vLLM's 256 (sentence-transformers)
    assert (card.kind, card.max_model_len, card.embedding_dim) == ("embed", 256, 384)
    pool = build_pool(specs[-1], "cpu", None)
    assert pool.deferred and pool.card == card
    gen_card = planned_card(specs[0].vllm)  # type: ignore[arg-type]
    assert gen_card.kind == "generate" and gen_card.max_model_len == 8192  # SmolLM2's max_position_embeddings
    with pytest.raises(ValueError):
        settings(embedding_start="later")
