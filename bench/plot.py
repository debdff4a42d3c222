"""Render a plot spec (JSON) to a PNG with matplotlib.

Usage: python bench/plot.py SPEC.json OUT.png

Spec: {"title": str, "note": str, "panels": [{"title", "xlabel", "ylabel",
"xscale", "yscale", "kind": "line" | "bar", "categories": [...] (bar),
"series": [{"label", "x": [...], "y": [...], "lo": [...], "hi": [...]}]}]}
`lo`/`hi` (optional) draw the spread of repeated runs.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(spec_path: str, out: str) -> None:
    spec = json.loads(open(spec_path).read())
    panels = spec["panels"]
    cols = min(len(panels), 3)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, p in zip([a for r in axes for a in r], panels, strict=False):
        kind = p.get("kind", "line")
        if kind == "bar":
            cats = p["categories"]
            n = len(p["series"])
            width = 0.8 / max(n, 1)
            for i, s in enumerate(p["series"]):
                xs = [j + (i - (n - 1) / 2) * width for j in range(len(cats))]
                ys = [v if v is not None else 0 for v in s["y"]]
                ax.bar(xs, ys, width, label=s["label"])
                if s.get("lo") and s.get("hi"):
                    err = [
                        [max(0, y - (lo if lo is not None else y)) for y, lo in zip(ys, s["lo"], strict=False)],
                        [max(0, (hi if hi is not None else y) - y) for y, hi in zip(ys, s["hi"], strict=False)],
                    ]
                    ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor="black", capsize=2, lw=0.8)
            ax.set_xticks(range(len(cats)), [str(c) for c in cats])
        else:
            for s in p["series"]:
                pts = [(x, y) for x, y in zip(s["x"], s["y"], strict=False) if y is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=False)
                ax.plot(xs, ys, marker="o", label=s["label"])
                if s.get("lo") and s.get("hi"):
                    band = [
                        (x, lo, hi)
                        for x, lo, hi in zip(s["x"], s["lo"], s["hi"], strict=False)
                        if lo is not None and hi is not None
                    ]
                    if band:
                        bx, blo, bhi = zip(*band, strict=False)
                        ax.fill_between(bx, blo, bhi, alpha=0.2)
        if p.get("xscale"):
            ax.set_xscale(p["xscale"])
        if p.get("yscale"):
            ax.set_yscale(p["yscale"])
        ax.set_title(p.get("title", ""), fontsize=10)
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_ylabel(p.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in [a for r in axes for a in r][len(panels) :]:
        ax.axis("off")
    fig.suptitle(spec.get("title", ""), fontsize=11)
    if spec.get("note"):
        fig.text(0.01, 0.005, spec["note"], fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
