"""The settings' parsed values, computed once while the settings validate.

Each validator of server/settings.py that parses a raw value (`NAME=...`
entries, policies, proxies, LoRA modules) hands what it parsed to `keep`;
the settings' outermost validator (`collect`) gathers those into one
`Parsed`, `Settings.parsed`. Pools, routes, the access log and a SIGHUP
reload read that, and never parse the strings again. The raw fields stay as
given, so the flags, `--help` and the flag reference do not change, and a
bad value fails in its own field's validator with the message it always had.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from engine_adapter.entry import parse_entry

if TYPE_CHECKING:
    from engine_adapter.lora import LoraModule
    from engine_adapter.routing.spec import RouteSpec
    from engine_adapter.routing.upstream import UpstreamConfig

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_proxies(items: Iterable[str]) -> tuple[Network, ...]:
    """`10.0.0.1`, `10.0.0.0/8`, `::1` -> networks; raises ValueError."""
    return tuple(ipaddress.ip_network(s.strip(), strict=False) for s in items if s.strip())


@dataclass(frozen=True)
class ExtraModel:
    """One `--extra-model NAME[,ALIAS...]=PATH[;devices=ID,ID...]`."""

    names: tuple[str, ...]
    path: str
    devices: tuple[str, ...] | None  # its engines' own devices, or None


@dataclass(frozen=True)
class Parsed:
    """What the raw settings mean, parsed once (`Settings.parsed`). Read
    only; plain containers, so that the settings pickle (`--workers` spawns)."""

    upstreams: tuple[UpstreamConfig, ...]  # --upstream, with the --upstream-* defaults
    policies: tuple[str, Mapping[str, str]]  # --routing-policy: (default, {model: policy})
    routes: Mapping[str, RouteSpec]  # --alias and --fallback
    proxies: tuple[Network, ...]  # --trusted-proxies
    lora_modules: tuple[LoraModule, ...]  # --lora-modules
    extra_models: tuple[ExtraModel, ...]  # --extra-model


# The values parsed so far in the validation running in this context.
_PENDING: ContextVar[dict[str, Any] | None] = ContextVar("npugw_settings_parsed", default=None)

T = TypeVar("T")
M = TypeVar("M")


def keep(name: str, value: T) -> T:
    """A validator's parsed value, for the `Parsed` field `name`."""
    pending = _PENDING.get()
    if pending is not None:
        pending[name] = value
    return value


def collect(data: Any, handler: Callable[[Any], M]) -> M:
    """Validate (`handler`), then store what the validators kept as the
    model's `_parsed`. On an assignment (validate_assignment) only the
    assigned field's validators and the model's run: the rest is kept."""
    token = _PENDING.set({})
    try:
        model = handler(data)
        found = _PENDING.get() or {}
    finally:
        _PENDING.reset(token)
    old = getattr(model, "_parsed", None)
    model._parsed = replace(old, **found) if old is not None else Parsed(**found)  # type: ignore[attr-defined]
    return model


def _json_or_str(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_engine_args(v: Any) -> dict[str, Any]:
    """`KEY=VALUE` items (flags), a JSON object (environment) or a mapping
    (YAML) -> {vLLM engine argument: value}. A key the gateway sets from its
    own settings is refused with the flag to use instead."""
    from engine_adapter.backends.vllm_config import gateway_engine_keys

    if v is None:
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except ValueError as e:
            raise ValueError(f"engine args {v!r}: expected a JSON object ({e})") from None
        if not isinstance(v, dict):
            raise ValueError(f"engine args {v!r}: expected a JSON object of KEY: VALUE")
    elif isinstance(v, list | tuple):
        items: dict[str, Any] = {}
        for item in v:
            entry = parse_entry(str(item), "--engine-arg", "KEY=VALUE", many=False)
            items[entry.name] = _json_or_str(entry.items[0])
        v = items
    if not isinstance(v, Mapping):
        raise ValueError("engine args: expected KEY=VALUE items, a JSON object or a mapping")
    own = gateway_engine_keys()
    out: dict[str, Any] = {}
    for key, value in v.items():
        name = str(key).strip().replace("-", "_")
        if not name.isidentifier():
            raise ValueError(f"--engine-arg {key!r}: KEY must be a vLLM engine argument name (letters, digits, _ or -)")
        if name in own:
            raise ValueError(f"--engine-arg {name}: the gateway sets {name} itself; use {own[name]}")
        out[name] = value
    return out


_EXTRA_MODEL_SYNTAX = "NAME[,ALIAS...]=PATH[;devices=ID,ID...]"


def parse_extra_model(item: str) -> ExtraModel:
    """`NAME[,ALIAS...]=PATH[;devices=...]` -> ExtraModel."""
    e = parse_entry(item, "--extra-model", _EXTRA_MODEL_SYNTAX, options=("devices",), many=False)
    names = tuple(n.strip() for n in e.name.split(",") if n.strip())
    if not names or not e.items[0]:
        raise ValueError(f"--extra-model {item!r}: expected {_EXTRA_MODEL_SYNTAX}")
    devices = None
    if "devices" in e.options:
        devices = tuple(p.strip() for p in e.options["devices"].split(",") if p.strip())
        if not devices:
            raise ValueError(f"--extra-model {item!r}: devices= names no device")
    return ExtraModel(names, e.items[0], devices)


__all__ = ["ExtraModel", "Parsed", "collect", "keep", "parse_engine_args", "parse_extra_model"]
