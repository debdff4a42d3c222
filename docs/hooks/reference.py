"""mkdocs hook: the pages generated from the code at build time.

- reference/flags.md, metrics.md, errors.md, promql.md: `server.docs_gen`
  (the settings model, the app's Prometheus registry, server/errors.py,
  the Grafana dashboard and the alert rules);
- deploy/index.md, deploy/nginx.md, deploy/ray.md: the guides kept beside
  the files they describe (deploy/README.md, deploy/nginx/README.md,
  deploy/ray/README.md), with their links pointed at the site's pages.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

# deploy/ guides: (source, page, {link in the source: link on the page})
GUIDES = (
    ("deploy/README.md", "deploy/index.md", {"nginx/README.md": "nginx.md", "ray/README.md": "ray.md"}),
    ("deploy/nginx/README.md", "deploy/nginx.md", {"../README.md": "index.md"}),
    ("deploy/ray/README.md", "deploy/ray.md", {"../README.md": "index.md"}),
)


def _guide(source: str, links: dict[str, str]) -> str:
    """A guide as a page: its links to the other guides point at their pages;
    a link to any other file of the repository becomes the file's path."""
    text = (ROOT / source).read_text()
    folder = Path(source).parent

    def fix(m: re.Match[str]) -> str:
        label, target, anchor = m.group(1), m.group(2), m.group(3) or ""
        if target in links:
            return f"[{label}]({links[target]}{anchor})"
        if re.match(r"^[a-z]+://", target):
            return m.group(0)
        path = os.path.normpath(folder / target)
        return label if label.strip("`") == path else f"{label} (`{path}`)"

    text = re.sub(r"\[([^\]]*)\]\(([^)#\s]*)(#[^)\s]*)?\)", fix, text)
    return f"<!-- generated from {source} at build time: edit that file -->\n" + text


def on_files(files: Files, config: Any) -> Files:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.path[0] != str(ROOT):  # this checkout's code, before any installed copy
        sys.path.insert(0, str(ROOT))
    from server import docs_gen

    pages = docs_gen.pages()
    for source, page, links in GUIDES:
        pages[page] = _guide(source, links)
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files
