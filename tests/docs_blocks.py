"""The documentation's code blocks marked to run as pasted: a fence right
after a `<!-- docs-test: run -->` line, in README.md or a page under docs/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from support import REPO

MARK = "<!-- docs-test: run -->"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def marked_blocks(root: Path = REPO) -> list[Block]:
    out: list[Block] = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if before.strip() == MARK:
                line = text.count("\n", 0, m.start()) + 1
                out.append(Block(str(path.relative_to(root)), line, m.group(1), m.group(2)))
    return out
