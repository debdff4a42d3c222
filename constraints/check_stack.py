"""Check that this Python environment already holds the engine stack a
constraints file names, at those versions, before the gateway is installed
on top of it (the vllm-ascend image, or a host set up by vllm-ascend's own
procedure). Exits 1 naming each missing or different package.

    python3 constraints/check_stack.py constraints/npu.txt torch torch-npu vllm vllm-ascend

Local version labels are ignored (torch 2.10.0+cpu is 2.10.0; vLLM built
with VLLM_TARGET_DEVICE=empty reports 0.23.0+empty). Standard library only.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def pins(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^\s;#]+)", line)
            if m:
                out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def public(version: str) -> str:
    return version.split("+", 1)[0]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    wanted = pins(argv[0])
    problems = []
    for name in argv[1:]:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key not in wanted:
            problems.append(f"{name}: not pinned in {argv[0]}")
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed ({argv[0]} wants {wanted[key]})")
            continue
        if public(have) != public(wanted[key]):
            problems.append(f"{name}: installed {have}, {argv[0]} wants {wanted[key]}")
        else:
            print(f"[check_stack] {name} {have}: as {argv[0]} pins")
    for p in problems:
        print(f"[check_stack] {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
