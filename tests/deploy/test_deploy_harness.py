"""Self-tests of the test harness: the nginx / Prometheus starters and the
PromQL metric-name helper."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import deploy_services
import httpx
import pytest
from promql import contract_sample_names, grafana_query_metric_names, metric_names_in_promql
from support import wait_until_sync


@pytest.mark.e2e
def test_nginx_serves_a_static_file_and_stops_gracefully(
    nginx_factory: Callable[..., object], tmp_path: Path
) -> None:
    www = tmp_path / "www"
    www.mkdir()
    (www / "hello.txt").write_text("hello from nginx\n")
    port = deploy_services.free_port()
    conf = f"""
events {{ worker_connections 64; }}
http {{
    access_log /var/log/nginx/access.log;
    server {{
        listen 127.0.0.1:{port};
        location / {{ root {www}; }}
    }}
}}
"""
    proc = nginx_factory(conf)
    r = httpx.get(f"http://127.0.0.1:{port}/hello.txt", timeout=5)
    assert r.status_code == 200
    assert r.text == "hello from nginx\n"
    assert httpx.get(f"http://127.0.0.1:{port}/missing", timeout=5).status_code == 404
    # Logs went to the temp prefix, not /var/log.
    assert (tmp_path / "nginx" / "logs" / "access.log").read_text().count("GET /hello.txt") == 1
    assert deploy_services.stop_process(proc, signal.SIGQUIT) == 0  # type: ignore[arg-type]


@pytest.mark.e2e
def test_start_nginx_reports_a_broken_config(nginx_binary: str, tmp_path: Path) -> None:
    port = deploy_services.free_port()
    conf = f"events {{}}\nhttp {{ server {{ listen 127.0.0.1:{port}; no_such_directive on; }} }}\n"
    with pytest.raises(RuntimeError, match="no_such_directive"):
        deploy_services.start_nginx(conf, tmp_path / "bad", nginx=nginx_binary, timeout=5)


@pytest.mark.e2e
def test_prometheus_scrapes_itself(prometheus_factory: Callable[..., tuple[object, int]]) -> None:
    config = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: self
    static_configs:
      - targets: ["127.0.0.1:__PORT__"]
"""
    _proc, port = prometheus_factory(config)
    result: list[dict[str, object]] = []
    with httpx.Client(timeout=5) as client:

        def scraped() -> bool:
            nonlocal result
            body = client.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": 'up{job="self"}'}).json()
            assert body["status"] == "success"
            result = body["data"]["result"]
            return bool(result)

        wait_until_sync(scraped, timeout=30, what="Prometheus to scrape itself", interval=0.5)
    assert result[0]["value"][1] == "1"  # type: ignore[index]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('up{job="x"} == 0', {"up"}),
        (
            'npu_memory_usage_bytes{type="used"} / ignoring(type) npu_memory_usage_bytes{type="total"} > 0.8',
            {"npu_memory_usage_bytes"},
        ),
        (
            "histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket[5m])))",
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        (
            'sum(rate(a_total{x=~"$model_name", i=~"$instance"}[$__rate_interval])) / sum(rate(b_count[${w}]))',
            {"a_total", "b_count"},
        ),
        ("sum without (priority) (npugw_queue_depth) > 32", {"npugw_queue_depth"}),
        ("a * on (device) group_left (kind, type) b", {"a", "b"}),
        ("topk(5, c) or d unless e and f", {"c", "d", "e", "f"}),
        ("sum(x) by (le)", {"x"}),
        ('{__name__="vllm:num_requests_running", engine="0"}', {"vllm:num_requests_running"}),
        ("rate(m[5m] offset 1h) > bool 1e3", {"m"}),
        ('count_values("v", g) + label_replace(h, "dst", "$1", "src", "(.*)")', {"g", "h"}),
        ("max_over_time(q[10m:1m]) # a comment with word\n", {"q"}),
        ("vector(1) + scalar(time())", set()),
    ],
)
def test_metric_names_in_promql(expr: str, names: set[str]) -> None:
    assert metric_names_in_promql(expr) == names


def test_metric_names_fixture_is_the_helper(metric_names_in_promql: Callable[[str], set[str]]) -> None:
    assert metric_names_in_promql("rate(x_total[1m])") == {"x_total"}


def test_grafana_query_metric_names() -> None:
    assert grafana_query_metric_names("label_values(vllm:num_requests_running, model_name)") == {
        "vllm:num_requests_running"
    }
    assert grafana_query_metric_names('label_values(up{job="a,b"}, instance)') == {"up"}
    assert grafana_query_metric_names("label_values(instance)") == set()
    assert grafana_query_metric_names("query_result(sum(x))") == {"x"}


def test_contract_sample_names() -> None:
    names = contract_sample_names()
    assert "vllm:time_to_first_token_seconds_bucket" in names
    assert "vllm:iteration_tokens_total_bucket" in names
    assert "vllm:generation_tokens_total" in names
    assert "npu_memory_usage_bytes" in names
    assert "vllm:generation_tokens" not in names
