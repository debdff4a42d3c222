"""The vLLM backend on engines shaped like each vLLM version, without vLLM:
the unfinished-requests count (AsyncLLM.get_num_unfinished_requests() is
0.32+; 0.23, under vllm-ascend, has it on the output processor only), the
effective configuration (log, platform-override warnings, info gauges), and
the `--quantization ascend` folder check."""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from engine_adapter.backends import vllm_effective
from engine_adapter.backends.vllm import VllmEngine, unfinished_requests
from engine_adapter.backends.vllm_config import VllmConfig
from engine_adapter.metrics import EngineMetrics
from engine_adapter.model import ModelNotAvailable, check_quantized_model
from server.metrics import PoolCollector

# ------------------------------------------------------------ fake engines


class FakeOutputProcessor:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_num_unfinished_requests(self) -> int:
        return self.n


class CUDAGraphMode(Enum):
    NONE = 0
    PIECEWISE = 1
    FULL_AND_PIECEWISE = 3


@dataclass
class FakeVllmConfig:
    """The parts of vLLM's VllmConfig the adapter reads, as vllm-ascend
    leaves them with prefix caching on: block size 128, ACL graphs."""

    cache_config: Any = field(default_factory=lambda: _ns(
        block_size=128, enable_prefix_caching=True, cache_dtype="auto", num_gpu_blocks=4000,
        gpu_memory_utilization=0.9,
    ))
    model_config: Any = field(default_factory=lambda: _ns(
        enforce_eager=False, quantization=None, dtype="torch.bfloat16", max_model_len=8192,
    ))
    scheduler_config: Any = field(default_factory=lambda: _ns(max_num_batched_tokens=8192, max_num_seqs=256))
    compilation_config: Any = field(default_factory=lambda: _ns(cudagraph_mode=CUDAGraphMode.PIECEWISE))


class _NS:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _ns(**kw: Any) -> Any:
    return _NS(**kw)


class FakeAsyncLLM023:
    """vLLM 0.23's AsyncLLM as far as stats() goes: no
    get_num_unfinished_requests(), an output_processor that has it."""

    def __init__(self, unfinished: int) -> None:
        self.output_processor = FakeOutputProcessor(unfinished)
        self.vllm_config = FakeVllmConfig()
        self.errored = False


class FakeAsyncLLM032(FakeAsyncLLM023):
    """vLLM 0.32/0.33: the method is on AsyncLLM itself."""

    def __init__(self, unfinished: int) -> None:
        super().__init__(unfinished=-1)  # must not be read
        self._n = unfinished

    def get_num_unfinished_requests(self) -> int:
        return self._n


def engine_with(llm: Any, device: str = "npu", metrics: EngineMetrics | None = None, **cfg: Any) -> VllmEngine:
    e = VllmEngine(VllmConfig(model="/m", served_model_name="m", **cfg), device=device, metrics=metrics)
    e._llm = llm
    return e


# ------------------------------------------------------ unfinished requests

def test_unfinished_on_a_023_shaped_engine() -> None:
    llm = FakeAsyncLLM023(3)
    assert not hasattr(llm, "get_num_unfinished_requests")
    assert unfinished_requests(llm) == 3
    assert engine_with(llm).stats().unfinished == 3


def test_unfinished_on_a_032_shaped_engine() -> None:
    assert engine_with(FakeAsyncLLM032(5)).stats().unfinished == 5


def test_unfinished_without_an_engine() -> None:
    assert VllmEngine(VllmConfig(model="/m", served_model_name="m")).stats().unfinished == 0


class FakeWorker:
    def __init__(self, engine: VllmEngine) -> None:
        self.engine, self.index, self.alive, self.restarts = engine, 0, True, 0


class FakePool:
    """What PoolCollector reads of a pool."""

    def __init__(self, engine: VllmEngine) -> None:
        self.name, self.running, self.workers = "m", 0, [FakeWorker(engine)]
        self.counters = _ns(rejected={})
        self.deferred = False

    def queue_depth_by_priority(self) -> dict[int, int]:
        return {}

    def alive_workers(self) -> int:
        return 1

    def ready_workers(self) -> int:
        return 1


def test_the_unfinished_gauge_on_a_023_shaped_engine() -> None:
    """npugw_engine_unfinished_requests used to read 0 here (the scrape
    swallowed the AttributeError)."""
    registry = CollectorRegistry()
    pool = FakePool(engine_with(FakeAsyncLLM023(7)))
    registry.register(PoolCollector(lambda: [pool], dict))  # type: ignore[list-item]
    value = registry.get_sample_value("npugw_engine_unfinished_requests", {"model_name": "m", "engine": "0"})
    assert value == 7


# ------------------------------------------------------- effective config

def test_effective_config_read_from_vllm_config() -> None:
    eff = vllm_effective.read_effective(FakeVllmConfig())
    assert eff.block_size == 128 and eff.graph_mode == "PIECEWISE" and not eff.enforce_eager
    assert eff.dtype == "bfloat16" and eff.kv_cache_tokens == 4000 * 128
    assert eff.max_num_batched_tokens == 8192 and eff.max_num_seqs == 256
    eager = FakeVllmConfig()
    eager.model_config.enforce_eager = True
    assert vllm_effective.read_effective(eager).graph_mode == "eager"


def test_block_size_override_is_named() -> None:
    eff = vllm_effective.read_effective(FakeVllmConfig())
    lines = vllm_effective.platform_overrides({"block_size": 16, "max_num_seqs": 256, "dtype": "auto"}, eff, "npu")
    assert lines == [
        "--block-size 16 is replaced by 128 on npu (vllm-ascend uses 128 when prefix caching or chunked prefill is on)"
    ]
    assert vllm_effective.platform_overrides({"block_size": 128, "dtype": "bfloat16"}, eff, "npu") == []


def test_graph_mode_notice_only_when_the_platform_chose_it() -> None:
    eff = vllm_effective.read_effective(FakeVllmConfig())
    notice = vllm_effective.graph_notice(eff, "npu", {})
    assert notice is not None and "ACL graph" in notice and "--enforce-eager" in notice
    assert vllm_effective.graph_notice(eff, "npu", {"enforce_eager": False}) is None
    assert vllm_effective.graph_notice(eff, "cpu", {}) is None


def test_start_reports_and_exports_the_effective_config(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    engine = engine_with(FakeAsyncLLM023(0), metrics=EngineMetrics(registry), block_size=16)
    with caplog.at_level(logging.INFO, logger="engine_adapter.backends.vllm_effective"):
        engine._report_effective_config()
    text = caplog.text
    assert "block_size=128" in text and "graph=PIECEWISE" in text and "kv_cache=4000 blocks = 512000 tokens" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("--block-size 16 is replaced by 128 on npu" in w for w in warnings), warnings
    assert any("ACL graph capture is on" in w for w in warnings), warnings
    cache = registry.get_sample_value("vllm:cache_config_info", {
        "model_name": "m", "engine": "0", "block_size": "128", "cache_dtype": "auto", "num_gpu_blocks": "4000",
        "enable_prefix_caching": "true", "gpu_memory_utilization": "0.9",
    })
    assert cache == 1
    eng = registry.get_sample_value("npugw_engine_config_info", {
        "model_name": "m", "engine": "0", "device": "npu", "graph_mode": "PIECEWISE", "enforce_eager": "false",
        "max_num_batched_tokens": "8192", "max_num_seqs": "256", "max_model_len": "8192", "quantization": "",
        "dtype": "bfloat16", "kv_cache_tokens": "512000",
    })
    assert eng == 1


def test_a_restarted_engine_replaces_its_info_series() -> None:
    registry = CollectorRegistry()
    first = vllm_effective.read_effective(FakeVllmConfig())
    second_cfg = FakeVllmConfig()
    second_cfg.cache_config.num_gpu_blocks = 3900
    second = vllm_effective.read_effective(second_cfg)
    vllm_effective.export_info(registry, first, "npu", "m", 0)
    vllm_effective.export_info(registry, second, "npu", "m", 0)
    vllm_effective.export_info(registry, first, "npu", "m", 1)
    samples = [s for m in registry.collect() if m.name == "vllm:cache_config_info" for s in m.samples]
    assert sorted((s.labels["engine"], s.labels["num_gpu_blocks"]) for s in samples) == [("0", "3900"), ("1", "4000")]


# -------------------------------------------------- --quantization ascend

def write_safetensors(path: Path, dtypes: dict[str, str]) -> None:
    """A safetensors file with one-element tensors of the given dtypes."""
    sizes = {"I8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4}
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype in dtypes.items():
        header[name] = {"dtype": dtype, "shape": [1], "data_offsets": [offset, offset + sizes[dtype]]}
        offset += sizes[dtype]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


@pytest.fixture
def w8a8(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": "I8",
        "model.layers.0.self_attn.q_proj.deq_scale": "F32",
        "model.layers.0.mlp.down_proj.weight": "I8",
        "lm_head.weight": "BF16",
    })
    desc = {
        "model_quant_type": "W8A8",
        "model.layers.0.self_attn.q_proj.weight": "W8A8",
        "model.layers.0.self_attn.q_proj.deq_scale": "W8A8",
        "model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC",
        "lm_head.weight": "FLOAT",
    }
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    return tmp_path


def test_a_modelslim_folder_passes(w8a8: Path) -> None:
    check_quantized_model(w8a8, "ascend")


def test_other_quantizations_are_not_checked(tmp_path: Path) -> None:
    check_quantized_model(tmp_path, None)
    check_quantized_model(tmp_path, "fp8")


def test_no_description_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailable, match=r"has no quant_model_description.json; the weights are not ModelSlim"):
        check_quantized_model(tmp_path, "ascend")


def test_a_description_under_another_name(w8a8: Path) -> None:
    (w8a8 / "quant_model_description.json").rename(w8a8 / "quant_model_description_w8a8.json")
    with pytest.raises(ModelNotAvailable, match=r"it has quant_model_description_w8a8.json: rename"):
        check_quantized_model(w8a8, "ascend")


def test_an_unknown_weight_type(w8a8: Path) -> None:
    desc = json.loads((w8a8 / "quant_model_description.json").read_text())
    desc["model.layers.0.mlp.down_proj.weight"] = "W2A2"
    (w8a8 / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(ModelNotAvailable, match="does not implement: W2A2"):
        check_quantized_model(w8a8, "ascend")


def test_int8_types_need_int8_weights(w8a8: Path) -> None:
    write_safetensors(w8a8 / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": "BF16",
        "model.layers.0.mlp.down_proj.weight": "I8",
        "lm_head.weight": "BF16",
    })
    with pytest.raises(ModelNotAvailable, match=r"q_proj.weight is W8A8 but stored as BF16, not I8"):
        check_quantized_model(w8a8, "ascend")


def test_a_description_of_other_weights(w8a8: Path) -> None:
    write_safetensors(w8a8 / "model.safetensors", {"transformer.h.0.attn.weight": "I8"})
    with pytest.raises(ModelNotAvailable, match=r"3 of the 3 weights .* are not in"):
        check_quantized_model(w8a8, "ascend")


@pytest.mark.asyncio
async def test_start_refuses_the_folder_before_the_engine(tmp_path: Path) -> None:
    """The check runs in VllmEngine.start() before vLLM is imported or started."""
    engine = VllmEngine(VllmConfig(model=str(tmp_path), served_model_name="m", quantization="ascend"), device="npu")
    with pytest.raises(ModelNotAvailable, match=r"quant_model_description.json"):
        await engine.start()
