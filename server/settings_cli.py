"""The `serve` command's flags, one per setting (server/settings.py):
`--kebab-case` names, booleans as `--x/--no-x`, lists and `KEY=VALUE`
mappings repeatable; only flags given reach the Settings, so the
environment and the config file still fill the rest."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

from server.settings import Settings


def _is_bool(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    return annotation is bool or (bool in args and all(a in (bool, type(None)) for a in args))


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


# Flags not named after their setting: `--engine-arg K=V` fills engine_args.
_FLAG_NAMES = {"engine_args": "--engine-arg"}


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per setting; only flags given are returned."""
    for name, field in Settings.model_fields.items():
        flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        help_text = f"{field.description or ''} (default: {_default_text(field)}) [env NPUGW_{name.upper()}]"
        ann = field.annotation
        if _is_bool(ann):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif _is_list(ann):
            parser.add_argument(flag, action="extend", nargs="+", default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(ann) is dict:
            parser.add_argument(
                flag, dest=name, action="extend", nargs="+", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(flag, default=argparse.SUPPRESS, help=help_text)


def _default_text(field: Any) -> str:
    """A setting's default as `--help` shows it (as `vllm serve --help` does)."""
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is None:
        return "None"
    if isinstance(value, list | tuple | dict) and not value:
        return "none"
    if isinstance(value, Path):
        return str(value)
    return str(value).replace("%", "%%")  # argparse formats help with %


def settings_from_args(ns: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(ns).items() if k in Settings.model_fields}
    return Settings(**given)
