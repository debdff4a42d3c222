"""The documentation's reference pages, generated from the code so they
cannot drift: every `serve` flag (from the settings model), every metric
(from the Prometheus registry the app builds) and the error table (from
server/errors.py).

The docs site's build hook (docs/hooks/reference.py) calls `pages()`; by hand:
`python -m server.docs_gen OUTDIR` writes the same pages as files."""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from engine_adapter import errors as kinds
from server.settings import Settings
from server.settings_cli import TOPICS, _default_text, flag_of, topic_of

# ------------------------------------------------------------------ flags


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("%%", "%")


def flags_page() -> str:
    out = [
        "# Flags and environment variables",
        "",
        "Generated from the settings model (`server/settings.py`) when the site is built.",
        "Every flag of `npu-gateway serve` is also an environment variable `NPUGW_<NAME>` and a key",
        "of the YAML file given by `--config`. Precedence: flags, then environment, then the file,",
        "then the default. `npu-gateway serve --help` lists the same flags in the same topics.",
        "",
    ]
    by_topic: dict[str, list[str]] = {}
    for name in Settings.model_fields:
        by_topic.setdefault(topic_of(name), []).append(name)
    for topic in (*TOPICS, "other"):
        names = by_topic.get(topic)
        if not names:
            continue
        out += [f"## {topic.capitalize()}", "", "| flag | environment | default | meaning |", "|---|---|---|---|"]
        for name in names:
            field = Settings.model_fields[name]
            out.append(
                f"| `{flag_of(name)}` | `NPUGW_{name.upper()}` | `{_cell(_default_text(field))}` "
                f"| {_cell(field.description or '')} |"
            )
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------ metrics


def _families(registry: CollectorRegistry) -> Iterator[tuple[str, str, tuple[str, ...], str]]:
    """(name, type, labels, help) of every metric the registry exports."""
    for collector in list(registry._collector_to_names):  # no public list of collectors
        if isinstance(collector, MetricWrapperBase):
            yield collector._name, str(collector._type), tuple(collector._labelnames), collector._documentation
            continue
        for fam in collector.collect():
            labels = getattr(fam, "_labelnames", None)
            if labels is None:
                labels = sorted({k for s in fam.samples for k in s.labels if k not in ("le", "quantile")})
            yield fam.name, fam.type, tuple(labels), fam.documentation


class _KvEventsFamilies(Collector):
    """The kv-events policy's families, which an app exports only while a
    model routes on KV events."""

    def collect(self) -> Iterator[Metric]:
        from engine_adapter.routing.kv_metrics import kv_families

        yield from kv_families(())


async def _app_metrics() -> list[tuple[str, str, tuple[str, ...], str]]:
    """The registry of an app on the simulated backend, started (engines,
    device probes and the event loop's collector register at start-up), with
    the metrics only a vLLM engine or several processes add."""
    from engine_adapter.backends.vllm_effective import _info_gauges
    from server.app import create_app
    from server.metrics_multiproc import ProcessCollector
    from server.state_store import StateStore

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.model_validate(
            {"backend": "simulated", "data_dir": tmp, "embedding_model": "none", "device": "cpu"}
        )
        app = create_app(settings)
        registry: CollectorRegistry = app.state.registry
        _info_gauges(registry)  # vllm:cache_config_info, npugw_engine_config_info (a vLLM engine's)
        registry.register(ProcessCollector({}))  # npugw_process_http_requests (--workers N)
        registry.register(_KvEventsFamilies())  # npugw_kv_* (--routing-policy kv-events)
        store = StateStore("redis://127.0.0.1:6379/0", registry=registry)  # npugw_state_store_* (--state-url)
        await store.client.aclose()  # never connected: only its metrics are read
        async with app.router.lifespan_context(app):
            return list(_families(registry))


def metric_rows() -> list[tuple[str, str, tuple[str, ...], str]]:
    seen: dict[str, tuple[str, str, tuple[str, ...], str]] = {}
    for row in asyncio.run(_app_metrics()):
        seen.setdefault(row[0], row)
    return sorted(seen.values(), key=lambda r: (not r[0].startswith("vllm"), r[0]))


_SUFFIX = {"counter": "_total", "histogram": "_bucket, _sum, _count"}


def metrics_page(rows: list[tuple[str, str, tuple[str, ...], str]] | None = None) -> str:
    rows = metric_rows() if rows is None else rows
    out = [
        "# Metrics reference",
        "",
        "Generated from the Prometheus registry the app builds, when the site is built. `GET /metrics`",
        "serves them in Prometheus' text format (a counter's samples end in `_total`; a histogram's in",
        "`_bucket`, `_sum` and `_count`). The `vllm:` names are vLLM's own, so its dashboards work.",
        "",
    ]
    groups = (
        ("vLLM's names (per model and engine)", lambda n: n.startswith("vllm")),
        ("Devices", lambda n: n.startswith("npu_") or n.startswith("npugw_device")),
        ("The gateway's own", lambda n: True),
    )
    done: set[str] = set()
    for title, test in groups:
        picked = [r for r in rows if r[0] not in done and test(r[0])]
        if not picked:
            continue
        out += [f"## {title}", "", "| metric | type | labels | help |", "|---|---|---|---|"]
        for name, typ, labels, doc in picked:
            done.add(name)
            shown = ", ".join(f"`{label}`" for label in labels) or "none"
            out.append(f"| `{name}` | {typ} | {shown} | {_cell(doc)} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------ errors

_FAMILIES = (
    ("OpenAI", "every route but the two below", '{"error": {"message", "type", "param", "code"}}'),
    ("Anthropic", "`/v1/messages`, `/v1/messages/count_tokens`", '{"type": "error", "error": {"type", "message"}}'),
    ("TGI", "`/generate`, `/generate_stream`, `POST /`", '{"error", "error_type"}'),
)


def _kinds() -> list[type[kinds.GatewayError]]:
    found = [c for c in vars(kinds).values() if isinstance(c, type) and issubclass(c, kinds.GatewayError)]
    tree = kinds.__doc__ or ""

    def place(c: type) -> tuple[int, str]:  # as engine_adapter/errors.py's tree lists them
        m = re.search(rf"\b{c.__name__}\b", tree)
        return (m.start() if m else len(tree), c.__name__)

    return sorted(found, key=place)


def errors_page() -> str:
    from server.errors import ANTHROPIC, OPENAI, TGI

    shapes = (OPENAI, ANTHROPIC, TGI)
    out = [
        "# Errors",
        "",
        "Generated from `server/errors.py` and `engine_adapter/errors.py` when the site is built.",
        "An error kind maps to one status and error type per API family; the same table serves",
        "JSON error bodies and, once a stream has begun, its error event (then `data: [DONE]`).",
        "Refusals (429, 503, 529) come before the first byte, with `Retry-After`.",
        "",
        "| family | paths | body |",
        "|---|---|---|",
        *(f"| {name} | {paths} | `{body}` |" for name, paths, body in _FAMILIES),
        "",
        "| kind | `code` (OpenAI) | OpenAI | Anthropic | TGI | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for cls in _kinds():
        if cls is kinds.UpstreamRejected:
            cells = ["the node's status, its body relayed as is"] * 3
        else:
            err = cls("x")
            cells = [f"{k.status} `{k.type}`" for k in (s.kind(err) for s in shapes)]
        code = f"`{cls.code}`" if cls.code else "the status"
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        out.append(f"| `{cls.__name__}` | {code} | {' | '.join(cells)} | {_cell(_meaning(cls, doc))} |")
    out.append("")
    return "\n".join(out)


def _meaning(cls: type, doc: str) -> str:
    """The kind's line in engine_adapter/errors.py's tree, else its docstring."""
    tree = kinds.__doc__ or ""
    m = re.search(rf"\b{cls.__name__}[ \t]+(\S.*)$", tree, re.M)
    return m.group(1).strip() if m else " ".join(doc.split())


# ------------------------------------------------------------------ PromQL

_REPO = Path(__file__).resolve().parents[1]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def promql_page(repo: Path = _REPO) -> str:
    """The expressions of the shipped Grafana dashboard and alert rules."""
    import json

    import yaml

    out = [
        "# PromQL of the dashboard and the alerts",
        "",
        "Generated from `deploy/grafana/dashboard.json` and `deploy/prometheus/rules.yml` when the",
        "site is built: the queries the shipped dashboard and alerts run, to copy into your own.",
        "`$model_name`, `$instance` and `$__rate_interval` are the dashboard's variables.",
        "",
        "## Dashboard panels",
        "",
    ]
    board = json.loads((repo / "deploy/grafana/dashboard.json").read_text())
    for panel in _panels(board.get("panels", [])):
        exprs = [(t.get("legendFormat") or "", t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
        if not exprs:
            continue
        out += [f"### {panel.get('title', '')}", ""]
        for legend, expr in exprs:
            out += [f"`{legend}`:" if legend else "", "", "```promql", expr.strip(), "```", ""]
    out += ["## Alert rules", ""]
    rules = yaml.safe_load((repo / "deploy/prometheus/rules.yml").read_text())
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            if "alert" not in rule:
                continue
            summary = rule.get("annotations", {}).get("description", "")
            out += [
                f"### {rule['alert']}",
                "",
                f"Severity `{rule.get('labels', {}).get('severity', '')}`, for `{rule.get('for', '0s')}`. {summary}",
                "",
                "```promql",
                str(rule["expr"]).strip(),
                "```",
                "",
            ]
    return "\n".join(out)


# ------------------------------------------------------------------ pages


def pages() -> dict[str, str]:
    """{path under docs/: markdown}."""
    return {
        "reference/flags.md": flags_page(),
        "reference/metrics.md": metrics_page(),
        "reference/errors.md": errors_page(),
        "reference/promql.md": promql_page(),
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m server.docs_gen OUTDIR")
    out = Path(args[0])
    for rel, text in pages().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)


if __name__ == "__main__":
    main()
