"""Engine placement on device groups (engine_adapter/placement.py) and the
device list it starts from (engine_adapter/devices/listing.py), fed with the
recorded npu-smi outputs in tests/fixtures/npu-smi."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_adapter.devices.listing import Device, DeviceListError, list_gpus, list_npus, npus_from_text, visible_subset
from engine_adapter.placement import EngineAsk, PlacementError, free_devices, place_engines, select_devices

F_910B_8 = "910b1_8npu_24.1.0_procs_vllm-ascend-312.txt"
F_A3 = "a3_910_93_16chip_25.2.0_procs_vllm-ascend-3002.txt"
F_DUO = "310p3_300iduo_4card_25.3.rc1_procs_vllm-ascend-6063.txt"
F_USAGES = "usages_910b1_-t_usages_-i_0_arthurchiao-blog.txt"
F_DCMI = "error_dcmi_init_-8005_vllm-ascend-2698.txt"

Load = Callable[[str], str]


def npus(load_fixture: Load, name: str = F_910B_8) -> list[Device]:
    return npus_from_text(load_fixture(name))


def envs(places: list[list[object]]) -> list[list[str]]:
    return [[dict(p.env)["ASCEND_RT_VISIBLE_DEVICES"] for p in group] for group in places]  # type: ignore[attr-defined]


# -- the device list -----------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    (F_910B_8, [str(i) for i in range(8)]),
    (F_A3, [str(i) for i in range(16)]),  # Phy-ID of each of the 16 chips
    (F_DUO, [str(i) for i in range(8)]),  # Device column; NPU ids are 0/96/32768/32896
])
def test_devices_from_recorded_tables(load_fixture: Load, name: str, expected: list[str]) -> None:
    devices = npus(load_fixture, name)
    assert [d.name for d in devices] == expected
    assert [d.index for d in devices] == list(range(len(expected)))


def test_logical_index_is_the_position_in_the_list() -> None:
    # A container given /dev/davinci3 and /dev/davinci5 lists NPUs 3 and 5; the runtime calls them 0 and 1.
    devices = [Device("3", 0), Device("5", 1)]
    (places,) = place_engines([EngineAsk("m", workers=2)], devices, "npu")
    assert [(p.names, dict(p.env)["ASCEND_RT_VISIBLE_DEVICES"]) for p in places] == [("3", "0"), ("5", "1")]


@pytest.mark.parametrize("name, error", [
    (F_USAGES, "cannot read"),
    (F_DCMI, "ret is -8005"),
])
def test_unreadable_npu_smi_output_names_the_command_and_first_line(load_fixture: Load, name: str,
                                                                    error: str) -> None:
    text = load_fixture(name)
    first = next(ln.strip() for ln in text.splitlines() if ln.strip())
    with pytest.raises(DeviceListError) as e:
        npus_from_text(text)
    assert "`npu-smi info`" in str(e.value) and first[:40] in str(e.value) and error in str(e.value)


def test_failing_npu_smi_names_the_command_and_its_first_line(
    make_script: Callable[[str], Path], fixture_dir: Path
) -> None:
    script = make_script(f"cat '{fixture_dir / F_DCMI}'; exit 1")
    with pytest.raises(DeviceListError, match=r"info` failed \(exit status 1\): DrvMngGetConsoleLogLevel failed"):
        list_npus(str(script))


def test_missing_npu_smi_and_recorded_file(tmp_path: Path, cat_fixture_script: Callable[[str], Path]) -> None:
    with pytest.raises(DeviceListError, match="not found"):
        list_npus(str(tmp_path / "npu-smi"))
    with pytest.raises(DeviceListError, match="cannot read the npu-smi output file"):
        list_npus(output_file=tmp_path / "none.txt")
    assert len(list_npus(str(cat_fixture_script(F_A3)))) == 16


def test_nvidia_smi_list(make_script: Callable[[str], Path]) -> None:
    assert [d.index for d in list_gpus(str(make_script("printf '0\\n1\\n2\\n'")))] == [0, 1, 2]
    with pytest.raises(DeviceListError, match="no GPU index list; its first line: 'NVIDIA-SMI has failed"):
        list_gpus(str(make_script("echo 'NVIDIA-SMI has failed because it could not communicate'")))


def test_visible_devices_of_the_gateway_narrow_the_default(load_fixture: Load) -> None:
    devices = npus(load_fixture)
    assert [d.name for d in visible_subset(devices, "ASCEND_RT_VISIBLE_DEVICES", {})] == [d.name for d in devices]
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    assert [d.name for d in visible_subset(devices, "ASCEND_RT_VISIBLE_DEVICES", env)] == ["4", "5"]
    with pytest.raises(DeviceListError, match="not a logical id"):
        visible_subset(devices, "ASCEND_RT_VISIBLE_DEVICES", {"ASCEND_RT_VISIBLE_DEVICES": "9"})


# -- placement -----------------------------------------------------------------


def test_each_worker_and_extra_model_gets_its_own_contiguous_group(load_fixture: Load) -> None:
    asks = [EngineAsk("qwen", workers=2, tensor_parallel=2), EngineAsk("small", workers=2)]
    places = place_engines(asks, npus(load_fixture), "npu")
    assert envs(places) == [["0,1", "2,3"], ["4", "5"]]
    assert [p.index for p in places[0]] == [0, 1]
    assert [d.name for d in free_devices(npus(load_fixture), places)] == ["6", "7"]


def test_pipeline_parallel_counts_in_the_group(load_fixture: Load) -> None:
    places = place_engines([EngineAsk("m", tensor_parallel=2, pipeline_parallel=2)], npus(load_fixture), "npu")
    assert envs(places) == [["0,1,2,3"]]


def test_embedding_takes_a_free_device_of_its_own(load_fixture: Load) -> None:
    asks = [EngineAsk("gen", workers=3, tensor_parallel=2), EngineAsk("emb", memory_fraction=0.05, embedding=True)]
    places = place_engines(asks, npus(load_fixture), "npu")
    assert envs(places) == [["0,1", "2,3", "4,5"], ["6"]]
    assert not places[1][0].shared


def test_embedding_shares_a_device_when_fractions_stay_under_095(load_fixture: Load) -> None:
    asks = [EngineAsk("gen", workers=4, tensor_parallel=2, memory_fraction=0.9),
            EngineAsk("emb", memory_fraction=0.05, embedding=True)]
    places = place_engines(asks, npus(load_fixture), "npu")
    assert envs(places)[1] == ["0"] and places[1][0].shared
    # a second model with a lower fraction is the better one to share with
    asks = [EngineAsk("gen", workers=2, tensor_parallel=2, memory_fraction=0.9),
            EngineAsk("low", workers=2, tensor_parallel=2, memory_fraction=0.6),
            EngineAsk("emb", memory_fraction=0.3, embedding=True)]
    assert envs(place_engines(asks, npus(load_fixture), "npu"))[2] == ["4"]


def test_embedding_refused_when_sharing_would_pass_095(load_fixture: Load) -> None:
    asks = [EngineAsk("gen", workers=8, memory_fraction=0.9), EngineAsk("emb", memory_fraction=0.1, embedding=True)]
    with pytest.raises(PlacementError, match=r"0\.90 \+ 0\.10 = 1\.00 .* over 0\.95"):
        place_engines(asks, npus(load_fixture), "npu")


def test_too_many_engines_refused_naming_need_and_free(load_fixture: Load) -> None:
    asks = [EngineAsk("qwen", workers=3, tensor_parallel=2), EngineAsk("big", tensor_parallel=4)]
    with pytest.raises(PlacementError) as e:
        place_engines(asks, npus(load_fixture), "npu")
    msg = str(e.value)
    assert "need 10 devices" in msg and "8 are available (0,1,2,3,4,5,6,7)" in msg
    assert "qwen: 3 x 2" in msg and "big: 1 x 4" in msg


def test_per_model_devices_override(load_fixture: Load) -> None:
    asks = [EngineAsk("a", workers=2, tensor_parallel=2), EngineAsk("b", tensor_parallel=2, devices=("2", "3"))]
    places = place_engines(asks, npus(load_fixture), "npu")
    assert envs(places) == [["0,1", "4,5"], ["2,3"]]  # `a` fills around b's own devices


@pytest.mark.parametrize("ask, error", [
    (EngineAsk("b", tensor_parallel=2, devices=("5", "6", "7")), "2 does not divide its 3 devices"),
    (EngineAsk("b", workers=2, tensor_parallel=2, devices=("4", "5")), "need 4 devices, 2 are given"),
    (EngineAsk("b", devices=("0",)), "already another model's"),
    (EngineAsk("b", devices=("9",)), "device 9 is not one the engines may use"),
])
def test_bad_per_model_devices(load_fixture: Load, ask: EngineAsk, error: str) -> None:
    asks = [EngineAsk("a", devices=("0",)), ask]
    with pytest.raises(PlacementError, match=error):
        place_engines(asks, npus(load_fixture), "npu")


def test_no_adjacent_run_is_refused(load_fixture: Load) -> None:
    devices = select_devices(npus(load_fixture), ["0", "1", "2", "3"])
    asks = [EngineAsk("a", devices=("1",)), EngineAsk("x", devices=("3",)), EngineAsk("b", tensor_parallel=2)]
    with pytest.raises(PlacementError, match="needs 2 adjacent free device"):
        place_engines(asks, devices, "npu")


def test_select_devices_refuses_unknown_and_duplicates(load_fixture: Load) -> None:
    devices = npus(load_fixture)
    assert [d.name for d in select_devices(devices, ["6", "7"])] == ["6", "7"]
    with pytest.raises(PlacementError, match="device 8 is not one the host lists"):
        select_devices(devices, ["7", "8"])
    with pytest.raises(PlacementError, match="device 3 is given twice"):
        select_devices(devices, ["3", "3"])


def test_gpu_placement_sets_cuda_visible_devices_in_nvidia_smi_order() -> None:
    (places,) = place_engines([EngineAsk("m", workers=2)], [Device("0", 0), Device("1", 1)], "cuda")
    assert [dict(p.env) for p in places] == [
        {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    ]


def test_worker_env_reaches_each_engine_and_keeps_its_other_variables() -> None:
    from engine_adapter.backends.vllm_config import VllmConfig

    cfg = VllmConfig(model="/m", served_model_name="m", process_env=(("X", "1"),),
                     worker_env=((("ASCEND_RT_VISIBLE_DEVICES", "0,1"),), (("ASCEND_RT_VISIBLE_DEVICES", "2,3"),)))
    assert dict(cfg.env_for(1)) == {"X": "1", "ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert "worker_env" not in cfg.engine_kwargs("npu")


def test_npu_engines_get_no_npu_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_adapter.backends.vllm_env import configure_process_env, process_defaults

    assert "PYTORCH_NPU_ALLOC_CONF" not in process_defaults("npu")
    for k in ("PYTORCH_NPU_ALLOC_CONF", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
        monkeypatch.setenv(k, "")  # recorded, so the test leaves them as they were
        monkeypatch.delenv(k)
    configure_process_env("npu")
    assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ


def test_an_engine_process_started_for_a_worker_sees_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable is in the environment the engine's processes inherit
    while they start (vllm.py constructs AsyncLLM inside engine_process_env),
    and the gateway's own environment is left as it was."""
    import subprocess
    import sys

    from engine_adapter.backends.vllm_config import VllmConfig
    from engine_adapter.backends.vllm_env import engine_process_env

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # the gateway's, e.g. set by an operator
    cfg = VllmConfig(model="/m", served_model_name="m",
                     worker_env=((("ASCEND_RT_VISIBLE_DEVICES", "0,1"),), (("ASCEND_RT_VISIBLE_DEVICES", "2,3"),)))
    child = [sys.executable, "-c", "import os; print(os.environ['ASCEND_RT_VISIBLE_DEVICES'])"]
    seen = []
    for index in (0, 1):
        with engine_process_env(cfg.env_for(index)):
            seen.append(subprocess.run(child, capture_output=True, text=True, timeout=60, check=True).stdout.strip())
    assert seen == ["0,1", "2,3"]
    assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
