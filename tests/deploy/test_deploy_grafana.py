"""deploy/grafana: the dashboard JSON and its provisioning. (Every panel
expression is also evaluated by a real Prometheus in
test_deploy_prometheus.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from promql import contract_sample_names, grafana_query_metric_names, metric_names_in_promql

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboard.json"
COMPOSE = GRAFANA.parent / "docker-compose.yml"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _all_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "npu-gateway"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert "id" not in dashboard or dashboard["id"] is None  # portable: no database id
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    assert source["type"] == "prometheus"
    assert ds["current"]["value"] == source["uid"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
            assert grafana_query_metric_names(v["query"]["query"]) <= contract_sample_names()


def test_every_panel_has_targets_on_the_variable_datasource(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert len(panels) >= 12
    for p in panels:
        assert p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert metric_names_in_promql(t["expr"]), (p["title"], t["expr"])


def test_layout_fits_and_does_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                assert cell not in cells, f"{p['title']} overlaps at {cell}"
                cells.add(cell)


def test_dashboard_covers_the_required_views(dashboard: dict[str, Any]) -> None:
    used: set[str] = set()
    for expr in _all_exprs(dashboard):
        used |= metric_names_in_promql(expr)
    required = {
        "vllm:generation_tokens_total",  # throughput
        "vllm:time_to_first_token_seconds_bucket",  # TTFT quantiles
        "vllm:inter_token_latency_seconds_bucket",  # ITL quantiles
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm_batch_tokens_processed_total",  # batch tokens
        "vllm:iteration_tokens_total_bucket",
        "npu_memory_usage_bytes",  # NPU memory per device
        "npugw_device_memory_bytes",
        "npugw_api_key_tokens_total",  # per-key usage
        "npugw_api_key_requests_total",
        "npugw_admission_rejections_total",  # rejections
        "npugw_queue_depth",
    }
    assert required <= used, required - used
    exprs = " ".join(_all_exprs(dashboard))
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in exprs
        assert f"histogram_quantile({q}, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket" in exprs


def test_dashboard_only_uses_contract_metrics(dashboard: dict[str, Any]) -> None:
    unknown = {name for e in _all_exprs(dashboard) for name in metric_names_in_promql(e)} - contract_sample_names()
    assert not unknown


def test_dashboard_provider_matches_the_compose_mounts() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "npu-gateway.yml").read_text())
    (prov,) = provider["providers"]
    assert prov["type"] == "file"
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    targets = {m.split(":")[1]: m.split(":")[0] for m in mounts if m.startswith("./")}
    dash_target = next(t for t, src in targets.items() if src == "./grafana/dashboard.json")
    assert str(Path(dash_target).parent) == prov["options"]["path"]
    assert targets["/etc/grafana/provisioning/dashboards"] == "./grafana/provisioning/dashboards"
    assert targets["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
