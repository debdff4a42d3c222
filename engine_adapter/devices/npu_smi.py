"""Parsers for Huawei Ascend `npu-smi` text output.

Layouts handled (see tests/fixtures/npu-smi/SOURCES.md for the recorded samples):

* the 98-column 910 / 910B table (`Chip` alone on header row 2, HBM sub-column);
* the A3 / 910_93 variant of it (`Chip  Phy-ID`, two chips per NPU split by a
  full-width `+----+` line, Power `-` on the second chip);
* the 106/107-column 310P / 310B table (`Chip    Device`, no HBM column, sparse
  card ids such as 32768, 300I Duo with two chips sharing one NPU id);
* the 116-column 26.0 wide table (wider metric fields, an extra
  `Process id in container` column in the process table);
* the process table (several rows per chip, blank names, "No running processes");
* `...` lines left by people who elided rows, trailing spaces, `59356/ 65536`.

Cells are found by splitting on `|` and numbers by whitespace after folding
`a / b` into `a/b`, so column widths never matter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

MIB = 1024 * 1024

_ERROR_CODE = re.compile(r"ret is\s*(-?\d+)")
_SLASH = re.compile(r"\s*/\s*")
_BORDER = re.compile(r"^\+[-=+]+\+$")
_NO_PROCS = re.compile(r"No running processes found in NPU\s+(\d+)")
_BANNER = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
_MISSING = frozenset({"", "-", "NA", "N/A", "--"})


class NpuSmiError(RuntimeError):
    """`npu-smi` failed, or its output is not something this module understands.

    `code` is the driver's return code when the text carries one
    (`dcmi module initialize failed. ret is -8005` -> -8005).
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class NpuProcess:
    """One row of the process table."""

    pid: int
    name: str
    memory_mb: int
    container_pid: int | None = None


@dataclass(frozen=True, slots=True)
class NpuChip:
    """One chip of `npu-smi info` (an NPU block has one chip, two on A3 / 300I Duo).

    `device_id` is the second number of the Chip cell: `Phy-ID` on A3, the
    logical `Device` id on 310P/310B; None on 910/910B where the cell has none.
    `memory_*` is the `Memory-Usage(MB)` pair (host DDR on 910, the card memory on
    310P), `hbm_*` the `HBM-Usage(MB)` pair (None where the table has no HBM column).
    """

    npu_id: int
    chip_id: int
    name: str
    health: str
    power_w: float | None
    temp_c: float | None
    aicore_percent: float | None
    memory_used_mb: int | None
    memory_total_mb: int | None
    hbm_used_mb: int | None
    hbm_total_mb: int | None
    bus_id: str | None
    device_id: int | None = None
    hugepages_used: int | None = None
    hugepages_total: int | None = None
    processes: tuple[NpuProcess, ...] = field(default=())

    @property
    def healthy(self) -> bool:
        return self.health == "OK"

    def memory_bytes(self) -> tuple[int, int]:
        """(used, total) bytes of the memory that models live in.

        HBM when the chip reports an HBM total > 0 (910 class), else the
        `Memory-Usage` pair (310P/310B); (0, 0) when neither is known.
        """
        if self.hbm_total_mb is not None and self.hbm_total_mb > 0:
            return (self.hbm_used_mb or 0) * MIB, self.hbm_total_mb * MIB
        if self.memory_total_mb is not None:
            return (self.memory_used_mb or 0) * MIB, self.memory_total_mb * MIB
        return 0, 0


def npu_smi_error_from_text(text: str) -> NpuSmiError:
    """Best NpuSmiError for output that is not a table (carries `ret is N` as code)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return NpuSmiError("npu-smi produced no output")
    for ln in lines:
        m = _ERROR_CODE.search(ln)
        if m:
            return NpuSmiError(f"npu-smi error: {ln}", int(m.group(1)))
    failed = [ln for ln in lines if "failed" in ln.lower() or "error" in ln.lower()]
    if failed:
        return NpuSmiError(f"npu-smi error: {failed[-1]}")
    return NpuSmiError(f"not npu-smi output: {lines[0][:120]!r}")


def _num(tok: str) -> float | None:
    if tok in _MISSING:
        return None
    try:
        return float(tok)
    except ValueError:
        raise NpuSmiError(f"bad number {tok!r} in npu-smi table") from None


def _int(tok: str) -> int | None:
    v = _num(tok)
    return None if v is None else int(v)


def _pair(tok: str) -> tuple[int | None, int | None]:
    if tok in _MISSING:
        return None, None
    parts = tok.split("/")
    if len(parts) != 2:
        raise NpuSmiError(f"expected 'used / total', got {tok!r}")
    return _int(parts[0]), _int(parts[1])


def _cells(line: str, lineno: int) -> list[str]:
    if not line.endswith("|"):
        raise NpuSmiError(f"truncated npu-smi table row at line {lineno}: {line[:60]!r}")
    return [c.strip() for c in line.split("|")[1:-1]]


def _metric_tokens(cell: str) -> list[str]:
    return _SLASH.sub("/", cell).split()


@dataclass(slots=True)
class _Layout:
    has_header: bool = False
    has_hbm: bool = False
    version: str | None = None


def _chip_from_rows(r1: list[str], r2: list[str], layout: _Layout, lineno: int) -> NpuChip:
    where = f"npu-smi device rows ending at line {lineno}"
    if len(r1) < 3 or len(r2) < 3:
        raise NpuSmiError(f"{where}: expected 3 cells per row")
    head = r1[0].split(maxsplit=1)
    ids = r2[0].split()
    top = _metric_tokens(r1[2])
    bottom = _metric_tokens(r2[2])
    want_bottom = 3 if layout.has_hbm else 2
    if len(head) != 2 or not 1 <= len(ids) <= 2 or len(top) != 3 or len(bottom) != want_bottom:
        raise NpuSmiError(f"{where}: unexpected cell contents {r1!r} / {r2!r}")
    try:
        npu_id, chip_id = int(head[0]), int(ids[0])
        device_id = int(ids[1]) if len(ids) == 2 else None
    except ValueError:
        raise NpuSmiError(f"{where}: NPU/chip ids are not integers: {r1[0]!r} / {r2[0]!r}") from None
    hp_used, hp_total = _pair(top[2])
    mem_used, mem_total = _pair(bottom[1])
    hbm_used, hbm_total = _pair(bottom[2]) if layout.has_hbm else (None, None)
    return NpuChip(
        npu_id=npu_id,
        chip_id=chip_id,
        name=head[1].strip(),
        health=r1[1] or "UNKNOWN",
        power_w=_num(top[0]),
        temp_c=_num(top[1]),
        aicore_percent=_num(bottom[0]),
        memory_used_mb=mem_used,
        memory_total_mb=mem_total,
        hbm_used_mb=hbm_used,
        hbm_total_mb=hbm_total,
        bus_id=None if r2[1] in _MISSING else r2[1],
        device_id=device_id,
        hugepages_used=hp_used,
        hugepages_total=hp_total,
    )


def _process_row(cells: list[str], lineno: int) -> tuple[int, int, NpuProcess] | None:
    if len(cells) == 1 and _NO_PROCS.search(cells[0]):
        return None
    if len(cells) < 4:
        raise NpuSmiError(f"bad npu-smi process row at line {lineno}: {cells!r}")
    ids = cells[0].split()
    try:
        npu_id, chip_id, pid = int(ids[0]), int(ids[1]), int(cells[1])
        mem = int(cells[3]) if cells[3] not in _MISSING else 0
        cpid = int(cells[4]) if len(cells) > 4 and cells[4] not in _MISSING else None
    except (ValueError, IndexError):
        raise NpuSmiError(f"bad npu-smi process row at line {lineno}: {cells!r}") from None
    return npu_id, chip_id, NpuProcess(pid=pid, name=cells[2], memory_mb=mem, container_pid=cpid)


def parse_npu_smi_info(text: str) -> list[NpuChip]:
    """Parse `npu-smi info` into one record per chip, in table order.

    Raises NpuSmiError for driver error texts (`... ret is -8005`), for text that
    is not an npu-smi table and for malformed or cut-off rows. A table with a
    header but no device rows gives [].
    """
    layout = _Layout()
    chips: list[NpuChip] = []
    procs: dict[tuple[int, int], list[NpuProcess]] = {}
    pending: tuple[list[str], int] | None = None
    in_procs = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("..."):  # `...` = rows elided by whoever copied it
            continue
        if _BORDER.match(line):
            if pending is not None:
                raise NpuSmiError(f"npu-smi device block cut short before line {lineno}")
            continue
        if line.startswith("+"):
            raise NpuSmiError(f"truncated npu-smi border at line {lineno}: {line[:60]!r}")
        if not line.startswith("|"):
            continue  # driver chatter such as `DrvMngGetConsoleLogLevel failed. (...)`
        cells = _cells(line, lineno)
        joined = " ".join(cells)
        banner = _BANNER.search(joined)
        if banner:
            layout.version = banner.group(2)
            continue
        second = cells[1] if len(cells) > 1 else ""
        if second == "Process id":
            in_procs = True
            continue
        if second == "Health":
            layout.has_header = True
            continue
        if second == "Bus-Id":
            layout.has_hbm = "HBM-Usage" in joined
            continue
        if not layout.has_header:
            raise NpuSmiError(f"npu-smi data row before the table header at line {lineno}")
        if in_procs:
            row = _process_row(cells, lineno)
            if row is not None:
                procs.setdefault((row[0], row[1]), []).append(row[2])
        elif pending is None:
            pending = (cells, lineno)
        else:
            chips.append(_chip_from_rows(pending[0], cells, layout, lineno))
            pending = None
    if not layout.has_header:
        raise npu_smi_error_from_text(text)
    if pending is not None:
        raise NpuSmiError(f"npu-smi output ends inside a device block (line {pending[1]})")
    return [replace(c, processes=tuple(procs.get((c.npu_id, c.chip_id), ()))) for c in chips]


def parse_npu_smi_version(text: str) -> str | None:
    """The `Version:` of the banner line, or None."""
    m = _BANNER.search(text)
    return m.group(2) if m else None


def parse_npu_smi_sections(text: str) -> list[dict[str, str]]:
    """Parse `Key : value` output (`-t usages`, `-t common`, ...) into sections.

    Sections are separated by blank lines (`-t common` repeats keys such as
    `Temperature(C)` in the `mcu` section). Raises NpuSmiError on error texts and
    when there is no `Key : value` line at all.
    """
    if _ERROR_CODE.search(text):
        raise npu_smi_error_from_text(text)
    sections: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            if current:
                sections.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise NpuSmiError(f"not npu-smi 'Key : value' output: {line[:80]!r}")
        current[key.strip()] = value.strip()
    if current:
        sections.append(current)
    if not sections:
        raise npu_smi_error_from_text(text)
    return sections


def parse_npu_smi_usages(text: str) -> dict[str, float]:
    """Parse `npu-smi info -t usages -i N` into {key: number}.

    e.g. {"HBM Usage Rate(%)": 4.0, "Aicore Usage Rate(%)": 0.0, "HBM Capacity(MB)": 65536.0}.
    Non-numeric values are left out; a key repeated in a later section keeps its
    first value.
    """
    out: dict[str, float] = {}
    for section in parse_npu_smi_sections(text):
        for key, value in section.items():
            if key in out:
                continue
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out
