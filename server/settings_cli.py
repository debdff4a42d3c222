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


# `serve --help` (and the docs' flag reference) in topics. A setting is
# placed by its exact name, else by the first prefix it starts with; one
# that matches neither is listed under "other" (add it here).
TOPICS: dict[str, tuple[str, ...]] = {
    "engine": (
        "model", "served_model_name", "embedding_", "worker_cpu_bind", "extra_model", "backend", "device",
        "max_model_len", "dtype", "enforce_eager", "max_num_seqs", "max_num_batched_tokens", "block_size",
        "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
        "gpu_memory_utilization", "quantization", "scheduling_policy", "seed", "load_format", "engine_args",
        "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_", "num_workers", "simulated_",
        "kv_cache", "npu_", "ascend_",
    ),
    "queue and limits": (
        "max_queue_size", "max_queue_wait", "request_timeout", "max_n", "max_request_body_bytes", "usage_",
        "fair", "queue_", "priority", "budget", "rate_", "limit",
    ),
    "routing": (
        "routing_", "upstream", "alias", "fallback", "canary_", "kv_events", "discover", "route",
    ),
    "auth": ("api_key", "api_keys_file", "metrics_api_key", "admin_api_key", "trusted_proxies"),
    "observability": (
        "log_level", "access_log_", "otlp_", "device_probe_interval", "profile_dir", "metrics", "trace",
    ),
    "deployment": (
        "config", "host", "port", "workers", "shutdown_timeout", "readiness_", "sse_keep_alive_interval",
        "data_dir", "responses_db", "state_",
    ),
}


def topic_of(name: str) -> str:
    """The `serve --help` topic of a setting: an exact name first, then the
    longest prefix that fits."""
    for topic, names in TOPICS.items():
        if name in names:
            return topic
    best = ("other", 0)
    for topic, names in TOPICS.items():
        for prefix in names:
            if name.startswith(prefix) and len(prefix) > best[1]:
                best = (topic, len(prefix))
    return best[0]


def flag_of(name: str) -> str:
    return _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per setting, grouped by topic in `--help`;
    only flags given are returned."""
    groups: dict[str, Any] = {}
    for topic in (*TOPICS, "other"):
        groups[topic] = parser.add_argument_group(topic)
    for name, field in Settings.model_fields.items():
        flag = flag_of(name)
        help_text = f"{field.description or ''} (default: {_default_text(field)}) [env NPUGW_{name.upper()}]"
        ann = field.annotation
        group = groups[topic_of(name)]
        if _is_bool(ann):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif _is_list(ann):
            group.add_argument(flag, action="extend", nargs="+", default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(ann) is dict:
            group.add_argument(
                flag, dest=name, action="extend", nargs="+", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(flag, default=argparse.SUPPRESS, help=help_text)


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
