"""The one parser for `NAME=ITEM[,ITEM...][;key=value...]` settings:
--alias, --fallback, --upstream, --extra-model and --engine-arg all read their entries through `parse_entry`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    items: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)


def parse_entry(
    spec: str, what: str, syntax: str, *, options: Collection[str] | None = None, many: bool = True
) -> Entry:
    """Split `spec` into its name, its items (comma-separated when `many`,
    else the whole rest, which may be empty) and, when `options` names the
    keys allowed, its `;key=value` options (`-` in a key reads as `_`).
    Raises ValueError naming the flag (`what`), the entry and the syntax."""
    head, *opts = spec.split(";") if options is not None else (spec,)
    name, sep, rest = head.partition("=")
    name = name.strip()
    if many:
        items = tuple(p.strip() for p in rest.split(",") if p.strip())
    else:
        items = (rest.strip(),)
    if not sep or not name or (many and not items):
        raise ValueError(f"{what} {spec!r}: expected {syntax}")
    parsed: dict[str, str] = {}
    for opt in (o.strip() for o in opts):
        if not opt:
            continue
        key, sep, value = (s.strip() for s in opt.partition("="))
        key = key.replace("-", "_")
        if not sep or options is None or key not in options:
            known = ", ".join(sorted(options or ()))
            raise ValueError(f"{what} {name!r}: unknown option {opt!r} (options: {known})")
        parsed[key] = value
    return Entry(name, items, parsed)
