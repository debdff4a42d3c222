"""npu-smi parsers against the recorded outputs in tests/fixtures/npu-smi."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine_adapter.devices import (
    NpuChip,
    NpuSmiError,
    parse_npu_smi_info,
    parse_npu_smi_sections,
    parse_npu_smi_usages,
    parse_npu_smi_version,
)

Load = Callable[[str], str]
MIB = 1024 * 1024

F_910B1 = "910b1_8npu_24.1.0_procs_vllm-ascend-312.txt"
F_910B2C_16 = "910b2c_16npu_24.1.rc1_procs_vllm-ascend-264.txt"
F_910B2C_2 = "910b2c_2npu_23.0.2.1_nputop-test.txt"
F_310B4 = "310b4_alarm_23.0.0_nputop-test.txt"
F_DUO = "310p3_300iduo_4card_25.3.rc1_procs_vllm-ascend-6063.txt"
F_PRO = "310p3_300ipro_6card_25.2.0_vllm-ascend-2712.txt"
F_GEN1 = "910_gen1_8npu_23.0.5_elided_redacted_mindcluster-doc.txt"
F_ELIDED = "910b1_8npu_23.0.rc2_elided_arthurchiao-blog.txt"
F_WIDE = "910b4_1npu_26.0.rc1_wide_triton-ascend-faq.txt"
F_A3 = "a3_910_93_16chip_25.2.0_procs_vllm-ascend-3002.txt"
F_COMMON = "common_910b1_-t_common_-i_1_arthurchiao-blog.txt"
F_ERR_8005 = "error_dcmi_init_-8005_vllm-ascend-2698.txt"
F_ERR_8020 = "error_device_used_-8020_cann-container-image-46.txt"
F_USAGE_GEN1 = "usages_910_gen1_-i_0_-t_usages_23.0.5_mindcluster-doc.txt"
F_USAGE_910B1 = "usages_910b1_-t_usages_-i_0_arthurchiao-blog.txt"

# (file, chip count, npu ids in order, version)
TABLES = [
    (F_910B1, 8, list(range(8)), "24.1.0"),
    (F_910B2C_16, 16, list(range(16)), "24.1.rc1"),
    (F_910B2C_2, 2, [0, 1], "23.0.2.1"),
    (F_310B4, 1, [0], "23.0.0"),
    (F_DUO, 8, [0, 0, 96, 96, 32768, 32768, 32896, 32896], "25.3.rc1"),
    (F_PRO, 6, [0, 32, 96, 32768, 32800, 32896], "25.2.0"),
    (F_GEN1, 2, [0, 7], "23.0.5"),
    (F_ELIDED, 3, [0, 1, 7], "23.0.rc2"),
    (F_WIDE, 1, [0], "26.0.rc1"),
    (F_A3, 16, [n for n in range(8) for _ in (0, 1)], "25.2.0"),
]
ERRORS = [(F_ERR_8005, -8005), (F_ERR_8020, -8020)]
KEY_VALUE = [F_COMMON, F_USAGE_GEN1, F_USAGE_910B1]


def chip(chips: list[NpuChip], npu_id: int, chip_id: int = 0) -> NpuChip:
    found = [c for c in chips if (c.npu_id, c.chip_id) == (npu_id, chip_id)]
    assert len(found) == 1, f"NPU {npu_id} chip {chip_id}: {len(found)} matches"
    return found[0]


def test_every_fixture_file_has_expectations(fixture_dir: Path) -> None:
    on_disk = {p.name for p in fixture_dir.glob("*.txt")}
    covered = {t[0] for t in TABLES} | {e[0] for e in ERRORS} | set(KEY_VALUE)
    assert on_disk == covered


@pytest.mark.parametrize(("name", "count", "npu_ids", "version"), TABLES)
def test_table_shape(load_fixture: Load, name: str, count: int, npu_ids: list[int], version: str) -> None:
    text = load_fixture(name)
    chips = parse_npu_smi_info(text)
    assert len(chips) == count
    assert [c.npu_id for c in chips] == npu_ids
    assert parse_npu_smi_version(text) == version
    for c in chips:
        used, total = c.memory_bytes()
        assert total > 0
        assert 0 <= used <= total


def test_910b1_hbm_and_process(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_910B1))
    c0 = chip(chips, 0)
    assert (c0.name, c0.health, c0.healthy) == ("910B1", "OK", True)
    assert (c0.power_w, c0.temp_c, c0.aicore_percent) == (89.1, 32.0, 0.0)
    assert (c0.hbm_used_mb, c0.hbm_total_mb) == (3437, 65536)
    assert (c0.memory_used_mb, c0.memory_total_mb) == (0, 0)
    assert c0.bus_id == "0000:C1:00.0"
    assert c0.device_id is None
    assert c0.memory_bytes() == (3437 * MIB, 65536 * MIB)
    assert len(c0.processes) == 1
    p = c0.processes[0]
    assert (p.pid, p.name, p.memory_mb, p.container_pid) == (641248, "", 113, None)
    assert all(c.processes == () for c in chips[1:])
    assert chip(chips, 7).hbm_used_mb == 3380


def test_910b2c_five_digit_used_without_space(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_910B2C_16))
    assert (chip(chips, 0).hbm_used_mb, chip(chips, 0).hbm_total_mb) == (59356, 65536)
    assert chip(chips, 4).hbm_used_mb == 59346
    assert chip(chips, 1).power_w == 103.1
    assert chip(chips, 15).bus_id == "0000:D0:00.0"
    assert [p.name for p in chip(chips, 0).processes] == ["vllm"]
    assert all([p.name for p in c.processes] == ["rayNPURayWork"] for c in chips[1:])
    assert chip(chips, 9).processes[0].memory_mb == 56057


def test_trailing_spaces_and_dashed_process_footer(load_fixture: Load) -> None:
    text = load_fixture(F_910B2C_2)
    assert all(line.endswith(" ") for line in text.splitlines())
    chips = parse_npu_smi_info(text)
    assert [(c.hbm_used_mb, c.hbm_total_mb) for c in chips] == [(20701, 65536), (20687, 65536)]
    assert [(p.pid, p.name, p.memory_mb) for p in chips[0].processes] == [(124528, "python3.8", 17400)]
    assert chips[1].processes == ()


def test_310b4_alarm_without_hbm_or_bus(load_fixture: Load) -> None:
    (c,) = parse_npu_smi_info(load_fixture(F_310B4))
    assert (c.name, c.health, c.healthy) == ("310B4", "Alarm", False)
    assert (c.memory_used_mb, c.memory_total_mb) == (3628, 15609)
    assert (c.hbm_used_mb, c.hbm_total_mb) == (None, None)
    assert c.bus_id is None
    assert (c.hugepages_used, c.hugepages_total) == (15, 15)
    assert (c.power_w, c.temp_c, c.device_id) == (0.0, 65.0, 0)
    assert c.memory_bytes() == (3628 * MIB, 15609 * MIB)


def test_300i_duo_two_chips_per_card(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_DUO))
    assert [c.chip_id for c in chips] == [0, 1] * 4
    assert [c.device_id for c in chips] == list(range(8))
    assert all(c.power_w is None and c.hbm_total_mb is None for c in chips)
    a, b = chip(chips, 0, 0), chip(chips, 0, 1)
    assert a.bus_id == b.bus_id == "0000:01:00.0"
    assert (a.memory_used_mb, a.memory_total_mb) == (35552, 44278)
    assert (b.memory_used_mb, b.memory_total_mb) == (35270, 43693)
    assert (a.hugepages_used, a.hugepages_total) == (16885, 16885)
    assert a.memory_bytes() == (35552 * MIB, 44278 * MIB)
    assert [(p.pid, p.memory_mb) for p in a.processes] == [(326429, 33842), (326430, 108)]
    assert [(p.pid, p.memory_mb) for p in b.processes] == [(326430, 34086)]
    assert chip(chips, 32896, 1).memory_used_mb == 1265
    assert all(c.processes == () for c in chips if c.npu_id != 0)


def test_300i_pro_sparse_card_ids(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_PRO))
    assert all(c.memory_total_mb == 21527 and c.hbm_total_mb is None for c in chips)
    assert [c.device_id for c in chips] == list(range(6))
    assert chip(chips, 32800).memory_used_mb == 1853
    assert chip(chips, 32800).bus_id == "0000:82:00.0"
    assert chip(chips, 96).temp_c == 52.0


def test_910_gen1_elided_prefers_hbm_over_ddr(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_GEN1))
    c0, c7 = chip(chips, 0), chip(chips, 7)
    assert c0.name == "xxx"
    assert (c0.memory_used_mb, c0.memory_total_mb) == (920, 13553)
    assert (c0.hbm_used_mb, c0.hbm_total_mb) == (0, 32768)
    assert c0.memory_bytes() == (0, 32768 * MIB)
    assert (c7.memory_used_mb, c7.memory_total_mb, c7.bus_id) == (2346, 15567, "0000:3D:00.0")
    assert c7.power_w == 67.0


def test_910b1_elided_rows_are_skipped(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_ELIDED))
    assert [c.hbm_used_mb for c in chips] == [4175, 4175, 4174]
    assert chip(chips, 7).bus_id == "0000:42:00.0"


def test_26_0_wide_layout(load_fixture: Load) -> None:
    (c,) = parse_npu_smi_info(load_fixture(F_WIDE))
    assert (c.name, c.power_w, c.temp_c) == ("910B4", 82.6, 32.0)
    assert (c.hbm_used_mb, c.hbm_total_mb) == (2871, 32768)
    assert c.processes == ()


def test_a3_two_chips_per_npu(load_fixture: Load) -> None:
    chips = parse_npu_smi_info(load_fixture(F_A3))
    assert [(c.npu_id, c.chip_id, c.device_id) for c in chips] == [
        (n, k, 2 * n + k) for n in range(8) for k in (0, 1)
    ]
    assert all(c.name == "Ascend910" for c in chips)
    assert all(c.power_w is None for c in chips if c.chip_id == 1)
    assert chip(chips, 0, 0).power_w == 211.3
    assert (chip(chips, 0, 0).hbm_used_mb, chip(chips, 0, 0).hbm_total_mb) == (61609, 65536)
    assert chip(chips, 7, 1).hbm_used_mb == 61631
    assert chip(chips, 4, 0).aicore_percent == 8.0
    assert chip(chips, 6, 0).aicore_percent == 6.0
    assert chip(chips, 0, 1).bus_id == "0000:9F:00.0"
    c00 = chip(chips, 0, 0)
    assert len(c00.processes) == 8
    assert all(p.memory_mb == 141 and p.name == "" for p in c00.processes)
    assert [p.pid for p in chip(chips, 0, 1).processes] == [929405]
    assert [p.memory_mb for p in chip(chips, 7, 1).processes] == [58782]
    assert sum(len(c.processes) for c in chips) == 23


@pytest.mark.parametrize(("name", "code"), ERRORS)
def test_error_texts_raise(load_fixture: Load, name: str, code: int) -> None:
    text = load_fixture(name)
    with pytest.raises(NpuSmiError, match=f"ret is {code}") as info:
        parse_npu_smi_info(text)
    assert info.value.code == code
    with pytest.raises(NpuSmiError) as info2:
        parse_npu_smi_usages(text)
    assert info2.value.code == code


def test_driver_chatter_before_table_is_ignored(load_fixture: Load) -> None:
    chatter = load_fixture(F_ERR_8005).splitlines()[0]
    assert chatter.startswith("DrvMngGetConsoleLogLevel failed")
    chips = parse_npu_smi_info(chatter + "\n" + load_fixture(F_910B1))
    assert len(chips) == 8


@pytest.mark.parametrize(
    "text",
    ["", "   \n\n", "hello world", '{"npu": 0}', "Usage: npu-smi info [-t type]", "| a | b |\n| c | d |"],
)
def test_garbage_raises(text: str) -> None:
    with pytest.raises(NpuSmiError):
        parse_npu_smi_info(text)


def test_key_value_text_is_not_a_table(load_fixture: Load) -> None:
    with pytest.raises(NpuSmiError, match="not npu-smi output"):
        parse_npu_smi_info(load_fixture(F_USAGE_910B1))


def test_truncated_mid_row_raises(load_fixture: Load) -> None:
    text = load_fixture(F_910B1)
    cut = text.index("3378 / 65536")  # inside NPU 1's second row
    with pytest.raises(NpuSmiError, match="truncated"):
        parse_npu_smi_info(text[:cut])


def test_truncated_mid_border_raises(load_fixture: Load) -> None:
    lines = load_fixture(F_910B1).splitlines()
    with pytest.raises(NpuSmiError, match="truncated"):
        parse_npu_smi_info("\n".join([*lines[:8], lines[8][:40]]))


def test_truncated_inside_block_raises(load_fixture: Load) -> None:
    lines = load_fixture(F_910B1).splitlines()
    assert lines[6].startswith("| 0     910B1")
    with pytest.raises(NpuSmiError, match="ends inside a device block"):
        parse_npu_smi_info("\n".join(lines[:7]))
    with pytest.raises(NpuSmiError, match="cut short"):
        parse_npu_smi_info("\n".join([*lines[:7], lines[8]]))


def test_truncated_at_block_boundary_keeps_complete_blocks(load_fixture: Load) -> None:
    lines = load_fixture(F_910B1).splitlines()
    chips = parse_npu_smi_info("\n".join(lines[:12]))
    assert [c.npu_id for c in chips] == [0, 1]


def test_corrupted_number_raises(load_fixture: Load) -> None:
    text = load_fixture(F_910B1).replace("3437 / 65536", "34x7 / 65536")
    with pytest.raises(NpuSmiError, match="34x7"):
        parse_npu_smi_info(text)


def test_no_device_table_is_empty(load_fixture: Load) -> None:
    lines = load_fixture(F_910B1).splitlines()
    header, footer = lines[:6], lines[-1:]  # banner + both header rows + `+===` rule
    assert header[-1].startswith("+====") and footer[0].startswith("+====")
    assert parse_npu_smi_info("\n".join(header + footer)) == []
    # The same with the real (empty) process-table header of that output.
    proc_header = lines[30:33]
    assert "Process id" in proc_header[1]
    assert parse_npu_smi_info("\n".join(header + footer + proc_header)) == []


def test_usages_910b1(load_fixture: Load) -> None:
    u = parse_npu_smi_usages(load_fixture(F_USAGE_910B1))
    assert u["HBM Usage Rate(%)"] == 4.0
    assert u["HBM Capacity(MB)"] == 65536.0
    assert u["Aicore Usage Rate(%)"] == 0.0
    assert u["DDR Capacity(MB)"] == 0.0
    assert "Aivector Usage Rate(%)" in u
    assert (u["NPU ID"], u["Chip Count"], u["Chip ID"]) == (0.0, 1.0, 0.0)


def test_usages_910_gen1(load_fixture: Load) -> None:
    u = parse_npu_smi_usages(load_fixture(F_USAGE_GEN1))
    assert u["DDR Capacity(MB)"] == 13553.0
    assert u["DDR Usage Rate(%)"] == 6.0
    assert u["HBM Capacity(MB)"] == 32768.0
    assert "Aivector Usage Rate(%)" not in u
    assert len(u) == 14


def test_common_sections(load_fixture: Load) -> None:
    text = load_fixture(F_COMMON)
    sections = parse_npu_smi_sections(text)
    assert [len(s) for s in sections] == [2, 9, 2]
    assert sections[1]["Aicore Count"] == "24"
    assert sections[1]["NPU Real-time Power(W)"] == "93.4"
    assert sections[2] == {"Chip Name": "mcu", "Temperature(C)": "38"}
    flat = parse_npu_smi_usages(text)
    assert flat["Temperature(C)"] == 46.0  # the chip's, not the mcu's
    assert "Chip Name" not in flat


@pytest.mark.parametrize("text", ["", "hello", "+-----+\n| x |"])
def test_usages_garbage_raises(text: str) -> None:
    with pytest.raises(NpuSmiError):
        parse_npu_smi_usages(text)


def test_usages_rejects_a_table(load_fixture: Load) -> None:
    with pytest.raises(NpuSmiError):
        parse_npu_smi_usages(load_fixture(F_910B1))
