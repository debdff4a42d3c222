"""deploy/prometheus: promtool checks and unit tests of the alert rules, and
a real Prometheus running the real config and rules against synthetic
/metrics pages (laid out per the gateway's metric contract, served by a real
nginx), which also evaluates every dashboard and HPA-adapter expression."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deploy_services
import httpx
import pytest
import yaml
from promql import GATEWAY_METRICS, contract_sample_names, metric_names_in_promql
from support import wait_until_sync

HERE = Path(__file__).resolve().parent
PROM_DIR = HERE.parents[1] / "deploy" / "prometheus"
CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "rules.yml"
RULES_TEST = HERE / "promtool_rules_test.yml"
DASHBOARD = HERE.parents[1] / "deploy" / "grafana" / "dashboard.json"
ADAPTER = HERE.parents[1] / "deploy" / "k8s" / "prometheus-adapter" / "rules-configmap.yaml"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def _alerts() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


# ------------------------------------------------------------- promtool

def test_promtool_check_config(promtool_binary: str) -> None:
    r = _run([promtool_binary, "check", "config", CONFIG.name], PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_check_rules(promtool_binary: str) -> None:
    r = _run([promtool_binary, "check", "rules", RULES.name], PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout + r.stderr


def test_promtool_unit_tests_of_the_alerts(promtool_binary: str) -> None:
    r = _run([promtool_binary, "test", "rules", RULES_TEST.name], HERE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_unit_tests_can_fail(promtool_binary: str, tmp_path: Path) -> None:
    # The same tests with the memory threshold moved to 90% must fail: the
    # 85% device no longer fires.
    rules = RULES.read_text().replace(
        'npu_memory_usage_bytes{type="total"} > 0.8', 'npu_memory_usage_bytes{type="total"} > 0.9'
    )
    assert rules != RULES.read_text()
    (tmp_path / "rules.yml").write_text(rules)
    test = yaml.safe_load(RULES_TEST.read_text())
    test["rule_files"] = ["rules.yml"]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(test))
    r = _run([promtool_binary, "test", "rules", "t.yml"], tmp_path)
    assert r.returncode != 0
    assert "NPUMemoryHigh" in r.stdout + r.stderr


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    doc = yaml.safe_load(RULES_TEST.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert fired == set(_alerts())
    # Every alert also has a not-firing evaluation, except two whose firing
    # cases already hold a healthy series beside the firing one.
    assert set(_alerts()) - quiet <= {"NPUUnhealthy", "VLLMKVCacheNearlyFull"}


def test_the_required_alert_expressions() -> None:
    alerts = _alerts()

    def expr(name: str) -> str:
        return " ".join(str(alerts[name]["expr"]).split())

    assert (
        expr("NPUMemoryHigh")
        == 'npu_memory_usage_bytes{type="used"} / ignoring(type) npu_memory_usage_bytes{type="total"} > 0.8'
    )
    assert expr("NPUGatewayNoReadyWorker") == "npugw_workers_ready == 0"
    assert "histogram_quantile(0.95," in expr("VLLMTimeToFirstTokenHigh")
    assert "vllm:time_to_first_token_seconds_bucket" in expr("VLLMTimeToFirstTokenHigh")
    assert re.search(r'status=~"429\|503"', expr("NPUGatewayRejectingRequests"))
    assert "npugw_queue_depth" in expr("NPUGatewayQueueDepthHigh")
    assert alerts["NPUGatewayQueueDepthHigh"]["for"] == "5m"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name


def test_rules_only_use_contract_metrics() -> None:
    known = contract_sample_names() | {"up"}
    for name, rule in _alerts().items():
        assert metric_names_in_promql(str(rule["expr"])) <= known, name


# ------------------------------------------ real Prometheus, synthetic data

_LABEL_VALUES: dict[str, list[str]] = {
    "model_name": ["SmolLM2-135M-Instruct"],
    "engine": ["0"],
    "finished_reason": ["stop", "length"],
    "device": ["0", "1"],
    "priority": ["normal"],
    "reason": ["queue_full"],
    "api_key_name": ["team-a"],
    "route": ["/v1/chat/completions"],
    "method": ["POST"],
    "status": ["200", "429"],
    "kind": ["npu"],
}


def _label_sets(labels: tuple[str, ...], family: str) -> list[dict[str, str]]:
    sets: list[dict[str, str]] = [{}]
    for label in labels:
        if label == "type":
            values = ["used", "total"] if family.endswith("memory_bytes") or family.startswith("npu_memory") else [
                "prompt",
                "completion",
            ]
        else:
            values = _LABEL_VALUES[label]
        sets = [{**s, label: v} for s in sets for v in values]
    return sets


def _fmt(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}" if inner else f"{name} {value}"


def synthetic_exposition(tick: int) -> str:
    """A /metrics page with every contract family. Counters grow with
    `tick`; device 0 is 85% full, device 1 50%."""
    out: list[str] = []
    for family, (kind, labels) in GATEWAY_METRICS.items():
        out.append(f"# HELP {family} synthetic")
        out.append(f"# TYPE {family} {kind}")
        for ls in _label_sets(labels, family):
            if kind == "counter":
                out.append(_fmt(family + "_total", ls, 100 * tick + 1))
            elif kind == "histogram":
                count = 10 * tick + 1
                for le in ("0.1", "1", "10", "+Inf"):
                    out.append(_fmt(family + "_bucket", {**ls, "le": le}, count if le != "0.1" else 0))
                out.append(_fmt(family + "_sum", ls, 0.5 * count))
                out.append(_fmt(family + "_count", ls, count))
            else:
                value = 1.0
                if family == "npu_memory_usage_bytes":
                    total = 64e9
                    value = total if ls["type"] == "total" else (0.85 if ls["device"] == "0" else 0.5) * total
                out.append(_fmt(family, ls, value))
    return "\n".join(out) + "\n"


def _nginx_metrics_conf(ports: list[int], www: Path) -> str:
    servers = "".join(
        f"""
    server {{
        listen 127.0.0.1:{port};
        location = /metrics {{
            default_type "text/plain; version=0.0.4";
            alias {www}/metrics-{k}.txt;
        }}
    }}"""
        for k, port in enumerate(ports)
    )
    return f"events {{ worker_connections 64; }}\nhttp {{\n    access_log off;{servers}\n}}\n"


def _grafana_to_promql(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def _adapter_queries() -> list[str]:
    cm = yaml.safe_load(ADAPTER.read_text())
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    out = []
    for rule in cfg["rules"] + cfg.get("externalRules", []):
        series = re.match(r"[\w:]+", rule["seriesQuery"])
        assert series
        q = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series.group(0))
            .replace("<<.LabelMatchers>>", 'namespace="npu-gateway",pod=~"npu-gateway-.*"')
            .replace("<<.GroupBy>>", "namespace,pod")
        )
        assert "<<" not in q, q
        out.append(q)
    return out


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [
        (f'{p["title"]} / {t["refId"]}', t["expr"])
        for p in dash["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


def _query(client: httpx.Client, base: str, expr: str) -> dict[str, Any]:
    r = client.get(f"{base}/api/v1/query", params={"query": expr})
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body


@pytest.mark.e2e
def test_real_prometheus_with_the_real_config(
    nginx_factory: Callable[..., object],
    prometheus_factory: Callable[..., tuple[object, int]],
    tmp_path: Path,
) -> None:
    # Two fake replicas' /metrics, served by nginx.
    www = tmp_path / "www"
    www.mkdir()
    ports = [deploy_services.free_port(), deploy_services.free_port()]
    for k in range(2):
        (www / f"metrics-{k}.txt").write_text(synthetic_exposition(0))
    nginx_factory(_nginx_metrics_conf(ports, www), name="metrics-nginx")

    # The real config: only targets and intervals changed; rules.yml beside it.
    config = yaml.safe_load(CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["global"]["scrape_timeout"] = "1s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    jobs["npu-gateway"]["static_configs"][0]["targets"] = [f"127.0.0.1:{p}" for p in ports]
    jobs["prometheus"]["static_configs"][0]["targets"] = ["127.0.0.1:__PORT__"]
    _proc, port = prometheus_factory(yaml.safe_dump(config), files={"rules.yml": RULES.read_text()})
    base = f"http://127.0.0.1:{port}"

    with httpx.Client(timeout=10) as client:
        # Let it scrape a few times with growing counters.
        ticks = itertools.count(1)

        def scraped() -> bool:  # each poll grows the counters the targets expose
            tick = next(ticks)
            for k in range(2):
                (www / f"metrics-{k}.txt").write_text(synthetic_exposition(tick))
            up = _query(client, base, 'count_over_time(up{job="npu-gateway"}[1m]) >= 4')["data"]["result"]
            return len(up) == 2

        wait_until_sync(scraped, timeout=40, what="both synthetic targets scraped 4 times", interval=0.5)

        targets = client.get(f"{base}/api/v1/targets").json()["data"]["activeTargets"]
        gw = [t for t in targets if t["labels"]["job"] == "npu-gateway"]
        assert len(gw) == 2 and all(t["health"] == "up" for t in gw), gw
        assert all(t["labels"]["service"] == "npu-gateway" for t in gw)

        # Every rule loaded and evaluates cleanly.
        groups = client.get(f"{base}/api/v1/rules").json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(loaded) == set(_alerts())
        def healthy() -> bool:
            nonlocal loaded
            groups = client.get(f"{base}/api/v1/rules").json()["data"]["groups"]
            loaded = {r["name"]: r for g in groups for r in g["rules"]}
            return all(r.get("health") == "ok" for r in loaded.values())

        wait_until_sync(healthy, timeout=10, interval=0.5,
                        what=lambda: str({n: (r.get("health"), r.get("lastError")) for n, r in loaded.items()}))

        # Device 0 is 85% full on both replicas: NPUMemoryHigh is pending
        # (its `for: 5m` has not passed); the 50% device is not.
        alerts = client.get(f"{base}/api/v1/alerts").json()["data"]["alerts"]
        mem = [a for a in alerts if a["labels"]["alertname"] == "NPUMemoryHigh"]
        assert {(a["labels"]["instance"], a["labels"]["device"], a["state"]) for a in mem} == {
            (f"127.0.0.1:{p}", "0", "pending") for p in ports
        }

        # Every dashboard expression evaluates and finds series.
        for title, expr in _dashboard_exprs():
            result = _query(client, base, _grafana_to_promql(expr))["data"]["result"]
            assert result, f"dashboard panel {title!r} finds no series: {expr}"

        # The HPA adapter's queries are valid PromQL too.
        for q in _adapter_queries():
            _query(client, base, q)

        # A broken expression is reported as such (the check above can fail).
        bad = client.get(f"{base}/api/v1/query", params={"query": "sum by (le (x)"})
        assert bad.status_code == 400


@pytest.mark.parametrize("tick", [0, 3])
def test_synthetic_exposition_covers_the_contract(tick: int) -> None:
    text = synthetic_exposition(tick)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert names == contract_sample_names()
