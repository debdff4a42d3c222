"""Summaries and a flame-graph SVG from py-spy's raw (collapsed) stacks.

Usage: python bench/flame.py STACKS.folded [OUT.svg] [--title T]
Prints the top functions (self and inclusive %) and the share of samples by
library. Frames look like `func (path/file.py:123)`.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

# Leaf file -> category; the first match wins.
CATEGORIES = [
    ("ours: server/", re.compile(r"(^|/)server/")),
    ("ours: engine_adapter/", re.compile(r"(^|/)engine_adapter/")),
    ("fastapi", re.compile(r"(^|/)fastapi/")),
    ("starlette", re.compile(r"(^|/)starlette/")),
    ("uvicorn", re.compile(r"(^|/)uvicorn/")),
    ("pydantic", re.compile(r"(^|/)pydantic(_core)?/")),
    ("prometheus_client", re.compile(r"(^|/)prometheus_client/")),
    ("vllm", re.compile(r"(^|/)vllm/")),
    ("tokenizers/transformers/jinja2", re.compile(r"(^|/)(transformers|tokenizers|jinja2)/")),
    ("msgspec/zmq (vllm IPC)", re.compile(r"(^|/)(msgspec|zmq)/")),
    ("aiohttp", re.compile(r"(^|/)aiohttp/")),
    ("anyio", re.compile(r"(^|/)anyio/")),
    ("asyncio/stdlib", re.compile(r"(^|/)(asyncio|python3\.\d+)/|^<frozen|^<string>")),
    ("logging", re.compile(r"(^|/)logging/")),
]


def parse(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        stacks.append((stack.split(";"), n))
    return stacks


def split_frame(frame: str) -> tuple[str, str, str]:
    m = _FRAME.match(frame)
    if not m:
        return frame, "", ""
    return m.group("func"), m.group("file"), m.group("line") or ""


def category(file: str) -> str:
    for name, rx in CATEGORIES:
        if rx.search(file):
            return name
    return "other"


def summarize(path: Path, top: int = 25) -> dict[str, Any]:
    stacks = parse(path)
    total = sum(n for _, n in stacks) or 1
    self_fn: Counter[str] = Counter()
    self_line: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    cat: Counter[str] = Counter()
    ours_entry: Counter[str] = Counter()  # outermost frame of our code, inclusive
    for frames, n in stacks:
        leaf = frames[-1]
        func, file, line = split_frame(leaf)
        self_fn[f"{func} ({file})"] += n
        self_line[f"{func} ({file}:{line})"] += n
        cat[category(file)] += n
        seen = set()
        innermost_ours = None
        for fr in frames:
            f, fl, _ = split_frame(fr)
            key = f"{f} ({fl})"
            if key not in seen:
                seen.add(key)
                incl_fn[key] += n
            if category(fl).startswith("ours"):
                innermost_ours = key
        if innermost_ours is not None:
            ours_entry[innermost_ours] += n

    def top_of(c: Counter[str]) -> list[dict[str, Any]]:
        return [{"frame": k, "samples": v, "pct": round(100 * v / total, 2)} for k, v in c.most_common(top)]

    return {
        "file": str(path),
        "samples": total,
        "by_category_self_pct": {k: round(100 * v / total, 2) for k, v in cat.most_common()},
        "top_self_functions": top_of(self_fn),
        "top_self_lines": top_of(self_line),
        "top_inclusive_functions": top_of(incl_fn),
        "innermost_our_frame_inclusive": top_of(ours_entry),
    }


# ---------------------------------------------------------------- SVG
def _tree(stacks: list[tuple[list[str], int]]) -> dict[str, Any]:
    root: dict[str, Any] = {"n": 0, "c": {}}
    for frames, n in stacks:
        node = root
        node["n"] += n
        for fr in frames:
            node = node["c"].setdefault(fr, {"n": 0, "c": {}})
            node["n"] += n
    return root


def _color(frame: str) -> str:
    _, file, _ = split_frame(frame)
    c = category(file)
    if c.startswith("ours"):
        return "#e0603a"
    palette = {
        "starlette": "#f2b134",
        "fastapi": "#f2c94c",
        "uvicorn": "#e9d66b",
        "pydantic": "#b5d46b",
        "asyncio/stdlib": "#9cc3e6",
        "vllm": "#8fbc8f",
        "prometheus_client": "#c39bd3",
    }
    return palette.get(c, "#d8d8d8")


def render_svg(path: Path, out: Path, title: str = "", width: int = 1400, row: int = 16) -> None:
    stacks = parse(path)
    root = _tree(stacks)
    total = root["n"] or 1
    rects: list[str] = []
    max_depth = 0

    def walk(node: dict[str, Any], name: str, x: float, depth: int) -> None:
        nonlocal max_depth
        w = node["n"] / total * width
        if w < 0.3:
            return
        max_depth = max(max_depth, depth)
        if depth >= 0:
            y = depth * row
            label = name if len(name) * 6.5 < w else (name[: max(0, int(w / 6.5) - 2)] + ".." if w > 25 else "")
            tip = f"{name} — {node['n']} samples ({100 * node['n'] / total:.2f}%)"
            rects.append(
                f'<g><title>{html.escape(tip)}</title><rect x="{x:.1f}" y="{{Y{y}}}" width="{w:.1f}" '
                f'height="{row - 1}" fill="{_color(name)}" rx="1"/>'
                f'<text x="{x + 3:.1f}" y="{{T{y}}}" font-size="11" font-family="monospace">{html.escape(label)}</text></g>'
            )
        cx = x
        for child_name, child in sorted(node["c"].items()):
            walk(child, child_name, cx, depth + 1)
            cx += child["n"] / total * width

    walk(root, "all", 0.0, -1)
    height = (max_depth + 1) * row + 40
    body = []
    for r in rects:  # flame graph: root at the bottom

        def sub(m: re.Match[str]) -> str:
            kind, y = m.group(1), int(m.group(2))
            top = height - 20 - y - row
            return str(top + (row - 4) if kind == "T" else top)

        body.append(re.sub(r"\{([YT])(\d+)\}", sub, r))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><rect width="100%" height="100%" fill="white"/>'
        f'<text x="5" y="14" font-size="13" font-family="sans-serif">{html.escape(title)} '
        f"({total} samples; orange = our code)</text>" + "".join(body) + "</svg>"
    )
    out.write_text(svg)


if __name__ == "__main__":
    args = sys.argv[1:]
    title = ""
    if "--title" in args:
        i = args.index("--title")
        title = args[i + 1]
        del args[i : i + 2]
    src = Path(args[0])
    s = summarize(src)
    print(json.dumps(s, indent=2))
    if len(args) > 1:
        render_svg(src, Path(args[1]), title)
