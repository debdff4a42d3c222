"""Metric names used by PromQL expressions, and the gateway's metric contract.

`metric_names_in_promql(expr)` returns the metric (sample) names an
expression selects, as written: `rate(vllm:time_to_first_token_seconds_bucket[5m])`
gives `{"vllm:time_to_first_token_seconds_bucket"}`. Those are the sample
names a /metrics page shows, so they can be compared with a live scrape
directly. Grafana variables (`$__rate_interval`, `$model_name`, `${x}`) are
accepted anywhere.

Importable from tests under tests/deploy as `promql` (conftest.py puts this
folder on sys.path); also offered as the `metric_names_in_promql` fixture.
"""

from __future__ import annotations

import re

__all__ = [
    "GATEWAY_METRICS",
    "contract_sample_names",
    "grafana_query_metric_names",
    "metric_names_in_promql",
]

# Keywords and operators that look like identifiers.
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
)
# Followed by a parenthesised list of label names, not expressions.
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|[0-9][0-9.]*(?:[eE][+-]?[0-9]+)?(?:[a-zA-Z][0-9a-zA-Z]*)*")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_NAME_MATCHER = re.compile(r"""__name__\s*=\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|`([^`]*)`)""")


def _skip_string(s: str, i: int) -> int:
    """`s[i]` opens a string; return the index after its end."""
    quote = s[i]
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\" and quote != "`":
            i += 2
            continue
        if c == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string in PromQL: {s!r}")


def _skip_block(s: str, i: int, open_: str, close: str) -> int:
    """`s[i]` is `open_`; return the index after the matching `close`."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c in "\"'`":
            i = _skip_string(s, i)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {open_}{close} in PromQL: {s!r}")


def _next_non_space(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def metric_names_in_promql(expr: str) -> set[str]:
    """The metric names selected by a PromQL expression (Grafana variables allowed)."""
    s = _GRAFANA_VAR.sub("1", expr)
    names: set[str] = set()
    i = 0
    while i < len(s):
        c = s[i]
        if c.isspace():
            i += 1
        elif c == "#":  # comment to end of line
            end = s.find("\n", i)
            i = len(s) if end < 0 else end + 1
        elif c in "\"'`":
            i = _skip_string(s, i)
        elif c == "{":
            end = _skip_block(s, i, "{", "}")
            for m in _NAME_MATCHER.finditer(s[i:end]):
                names.add(next(g for g in m.groups() if g is not None))
            i = end
        elif c == "[":
            i = _skip_block(s, i, "[", "]")
        elif c.isdigit() or (c == "." and i + 1 < len(s) and s[i + 1].isdigit()):
            m = _NUMBER.match(s, i)
            i = m.end() if m else i + 1
        elif c.isalpha() or c in "_:":
            m = _IDENT.match(s, i)
            assert m is not None
            word = m.group(0)
            i = m.end()
            j = _next_non_space(s, i)
            follows_paren = j < len(s) and s[j] == "("
            if not follows_paren:
                # `sum by (le) (...)`: an aggregation with its grouping first.
                nxt = _IDENT.match(s, j)
                if nxt is not None and nxt.group(0).lower() in ("by", "without"):
                    k = _next_non_space(s, nxt.end())
                    if k < len(s) and s[k] == "(":
                        i = _skip_block(s, k, "(", ")")
                        continue
            low = word.lower()
            if low in _LABEL_LIST_KEYWORDS:
                if follows_paren:
                    i = _skip_block(s, j, "(", ")")
            elif low in _KEYWORDS:
                pass
            elif follows_paren:
                pass  # a function or an aggregation
            else:
                names.add(word)
        else:
            i += 1
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*)\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((.*)\)\s*$", re.S)


def grafana_query_metric_names(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus template-variable query
    (`label_values(expr, label)`, `label_values(label)`, `query_result(expr)`)."""
    m = _LABEL_VALUES.match(query)
    if m:
        inner = m.group(1)
        # Split off the trailing ", label" at depth 0.
        depth = 0
        cut = -1
        k = 0
        while k < len(inner):
            ch = inner[k]
            if ch in "\"'`":
                k = _skip_string(inner, k)
                continue
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                depth -= 1
            elif ch == "," and depth == 0:
                cut = k
            k += 1
        return metric_names_in_promql(inner[:cut]) if cut >= 0 else set()
    m = _QUERY_RESULT.match(query)
    if m:
        return metric_names_in_promql(m.group(1))
    return metric_names_in_promql(query)


# The gateway's /metrics contract: family name -> (type, label names).
# Counters are listed by family name; their samples end in `_total`.
GATEWAY_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    # vLLM names
    "vllm:num_requests_running": ("gauge", ("model_name", "engine")),
    "vllm:num_requests_waiting": ("gauge", ("model_name", "engine")),
    "vllm:kv_cache_usage_perc": ("gauge", ("model_name", "engine")),
    "vllm:prompt_tokens": ("counter", ("model_name", "engine")),
    "vllm:generation_tokens": ("counter", ("model_name", "engine")),
    "vllm:request_success": ("counter", ("model_name", "engine", "finished_reason")),
    "vllm:num_preemptions": ("counter", ("model_name", "engine")),
    "vllm:prefix_cache_queries": ("counter", ("model_name", "engine")),
    "vllm:prefix_cache_hits": ("counter", ("model_name", "engine")),
    "vllm:iteration_tokens_total": ("histogram", ("model_name", "engine")),
    "vllm:time_to_first_token_seconds": ("histogram", ("model_name", "engine")),
    "vllm:inter_token_latency_seconds": ("histogram", ("model_name", "engine")),
    "vllm:e2e_request_latency_seconds": ("histogram", ("model_name", "engine")),
    "vllm:request_queue_time_seconds": ("histogram", ("model_name", "engine")),
    "vllm:request_prompt_tokens": ("histogram", ("model_name", "engine")),
    "vllm:request_generation_tokens": ("histogram", ("model_name", "engine")),
    # the seed deployment's names
    "vllm_num_running_requests": ("gauge", ("model_name", "engine")),
    "vllm_batch_tokens_processed": ("counter", ("model_name", "engine")),
    "npu_memory_usage_bytes": ("gauge", ("type", "device")),
    "npu_aicore_utilization_percent": ("gauge", ("device",)),
    "npu_health": ("gauge", ("device",)),
    # the gateway's own
    "npugw_queue_depth": ("gauge", ("model_name", "priority")),
    "npugw_admission_rejections": ("counter", ("model_name", "reason")),
    "npugw_api_key_requests": ("counter", ("api_key_name", "model_name")),
    "npugw_api_key_tokens": ("counter", ("api_key_name", "model_name", "type")),
    "npugw_http_requests": ("counter", ("route", "method", "status")),
    "npugw_http_request_duration_seconds": ("histogram", ("route",)),
    "npugw_workers_alive": ("gauge", ("model_name",)),
    "npugw_workers_ready": ("gauge", ("model_name",)),
    "npugw_device_memory_bytes": ("gauge", ("kind", "device", "type")),
}


def contract_sample_names() -> set[str]:
    """Every sample name the contract's families expose on /metrics."""
    out: set[str] = set()
    for family, (kind, _labels) in GATEWAY_METRICS.items():
        if kind == "counter":
            out.add(family + "_total")
        elif kind == "histogram":
            out.update(family + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            out.add(family)
    return out
