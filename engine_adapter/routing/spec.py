"""Route specifications as the settings, the admin API and SIGHUP give them.

    --alias    "chat-prod=qwen-v2:90,qwen-v3:10"   weights are relative
    --fallback "chat-prod=qwen-small,qwen-int8"     tried in order

A fallback list on a plain served name (no alias) routes that name through a
one-target router, so the name itself gets fallbacks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine_adapter.entry import parse_entry


@dataclass(frozen=True, slots=True)
class RouteSpec:
    alias: str
    targets: tuple[tuple[str, float], ...]  # (served name, weight)
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    """When a canary (a target with less than the largest weight) is rolled
    back: over the last `window` seconds, once it has `min_requests`, its
    error rate is above `max_error_rate` or its TTFT p95 above
    `max_ttft_p95` (None: that check is off). Checked at most every
    `check_every` seconds per target."""

    window: float = 60.0
    min_requests: int = 20
    max_error_rate: float | None = 0.5
    max_ttft_p95: float | None = None
    check_every: float = 1.0


def _name_weight(item: str) -> tuple[str, float]:
    name, sep, tail = item.rpartition(":")
    if sep and name:
        try:
            return name.strip(), float(tail)
        except ValueError:
            pass  # a ':' inside the name (llama3:8b): weight 1
    return item.strip(), 1.0


def _split(spec: str, what: str) -> tuple[str, list[str]]:
    e = parse_entry(spec, what, "NAME=ITEM[,ITEM...]")
    return e.name, list(e.items)


def parse_alias(spec: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """`ALIAS=TARGET[:WEIGHT][,TARGET[:WEIGHT]...]` (weight 1 if left out)."""
    alias, items = _split(spec, "alias")
    return alias, check_targets(alias, [_name_weight(i) for i in items])


def check_targets(alias: str, targets: Iterable[tuple[str, Any]]) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    for name, weight in targets:
        w = float(weight)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"alias {alias!r}: weight of {name!r} must be a number >= 0")
        if any(name == n for n, _ in out):
            raise ValueError(f"alias {alias!r}: target {name!r} is listed twice")
        out.append((str(name), w))
    if not out or not any(w > 0 for _, w in out):
        raise ValueError(f"alias {alias!r}: at least one target needs a weight above 0")
    return tuple(out)


def parse_fallback(spec: str) -> tuple[str, tuple[str, ...]]:
    """`NAME=FIRST[,SECOND...]`"""
    alias, items = _split(spec, "fallback")
    return alias, tuple(items)


def route_specs(aliases: Iterable[str], fallbacks: Iterable[str]) -> dict[str, RouteSpec]:
    table: dict[str, RouteSpec] = {}
    for spec in aliases:
        alias, targets = parse_alias(spec)
        if alias in table:
            raise ValueError(f"alias {alias!r} is defined twice")
        table[alias] = RouteSpec(alias, targets)
    seen: set[str] = set()
    for spec in fallbacks:
        alias, chain = parse_fallback(spec)
        if alias in seen:
            raise ValueError(f"fallback list of {alias!r} is defined twice")
        seen.add(alias)
        table[alias] = replace(table.get(alias) or RouteSpec(alias, ((alias, 1.0),)), fallbacks=chain)
    return table


def entries(value: Any) -> Any:
    """Settings values of the `NAME=...` lists from any source: a list (flags,
    YAML), a whitespace-separated string (environment), or a YAML mapping
    `{NAME: "a:90,b:10"}` / `{NAME: [a, b]}`."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, Mapping):
        return [f"{k}={','.join(map(str, v)) if isinstance(v, list | tuple) else v}" for k, v in value.items()]
    return value
