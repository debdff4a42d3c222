"""/metrics of the real gateway (the real vLLM engine, the embedded
SmolLM2-135M-Instruct) against real requests, promtool, a real Prometheus
running the deploy config and rules, and the Grafana dashboard.

Everything here uses the session's one real-engine gateway (`real_gateway`,
tests/conftest.py). It runs with --readiness-interval 3600, so no readiness
probe generation moves the engine counters during a test; other tests may run
before these, never at the same time, so before/after deltas are exact.

A CPU box has no NPU: the NPU-only series (npu_memory_usage_bytes,
npu_aicore_utilization_percent, npu_health) come from a second, simulated
gateway process started with `--device npu` and an `npu-smi` on its PATH that
prints a recorded npu-smi output (tests/fixtures/npu-smi/): the gateway's
real NpuSmiProbe -> DeviceMonitor -> DeviceCollector path exports them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deploy_services
import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from promql import grafana_query_metric_names, metric_names_in_promql
from support import EMBEDDED, GatewayProcess, metric_value, wait_until, wait_until_sync

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboard.json"
NPU_SMI_FIXTURE = REPO / "tests" / "fixtures" / "npu-smi" / "910b2c_16npu_24.1.rc1_procs_vllm-ascend-264.txt"
NPU_ONLY = {"npu_memory_usage_bytes", "npu_aicore_utilization_percent", "npu_health"}
CHAT_ROUTE = "/v1/chat/completions"
SIM_ARGS = ["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim"]

StartPrometheus = Callable[..., tuple[subprocess.Popen[bytes], int]]


# ----------------------------------------------------------------- helpers

def tool(name: str) -> str:
    try:
        return deploy_services.find_binary(name)
    except deploy_services.BinaryMissing as exc:
        pytest.fail(str(exc), pytrace=False)


def scrape(gw: GatewayProcess) -> str:
    r = httpx.get(gw.url + "/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the matching samples; 0 where none exists yet (a labelled
    counter appears on its first increment)."""
    try:
        return metric_value(text, name, **labels)
    except KeyError:
        return 0.0


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def chat(gw: GatewayProcess, content: str, max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(
        gw.url + CHAT_ROUTE,
        json={
            "model": EMBEDDED,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=180,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def panel_exprs(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    for p in panels:
        yield from panel_exprs(p.get("panels") or [])
        for t in p.get("targets") or []:
            if t.get("expr"):
                yield p.get("title", "?"), t["expr"]


@pytest.fixture(scope="module")
def npu_fixture_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A simulated-engine gateway with `--device npu` whose `npu-smi` prints a
    recorded 16-NPU Atlas 800I A2 output (device memory ~90% used)."""
    tmp = tmp_path_factory.mktemp("npu-fixture-gateway")
    bindir = tmp / "bin"
    bindir.mkdir()
    script = bindir / "npu-smi"
    script.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(NPU_SMI_FIXTURE))}\n")
    script.chmod(0o755)
    gw = GatewayProcess(
        [*SIM_ARGS, "--device", "npu"],
        tmp / "gateway.log",
        env={"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    try:
        gw.wait_ready(timeout=90)
        yield gw
    finally:
        gw.stop()


# ------------------------------------------------- counters, histograms

def test_engine_counters_move_by_exactly_the_served_usage(real_gateway: GatewayProcess) -> None:
    m = {"model_name": EMBEDDED}
    before = scrape(real_gateway)
    usages = [
        chat(real_gateway, prompt)["usage"]
        for prompt in ("Say hi.", "Name a colour.", "What is the capital of France?")
    ]
    prompt_sum = sum(u["prompt_tokens"] for u in usages)
    completion_sum = sum(u["completion_tokens"] for u in usages)
    assert prompt_sum > 0 and completion_sum > 0

    def delta(after: str, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The stat logger runs once per engine step: let it catch up, then the
    # deltas must be exact (not merely >=).
    def reported() -> bool:
        after = scrape(real_gateway)
        return (delta(after, "vllm:request_success_total", **m) >= 3
                and delta(after, "vllm:e2e_request_latency_seconds_count", **m) >= 3)

    wait_until_sync(reported, timeout=60, what="the engine's stat logger to report the requests", interval=0.2)
    time.sleep(0.5)
    after = scrape(real_gateway)

    assert delta(after, "vllm:prompt_tokens_total", **m) == prompt_sum
    assert delta(after, "vllm:generation_tokens_total", **m) == completion_sum
    assert delta(after, "vllm:request_success_total", **m) == 3
    # Histograms: one observation per request ...
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens"):
        assert delta(after, f"{hist}_count", **m) == 3, hist
        assert delta(after, f"{hist}_bucket", le="+Inf", **m) == 3, hist
    assert delta(after, "vllm:request_prompt_tokens_sum", **m) == prompt_sum
    assert delta(after, "vllm:request_generation_tokens_sum", **m) == completion_sum
    # ... one per token after the first ...
    assert delta(after, "vllm:inter_token_latency_seconds_count", **m) == completion_sum - 3
    # ... and one per engine step (every generated token needs a step).
    steps = delta(after, "vllm:iteration_tokens_total_count", **m)
    assert steps >= max(u["completion_tokens"] for u in usages)
    batch = delta(after, "vllm_batch_tokens_processed_total", **m)
    assert completion_sum <= batch <= prompt_sum + completion_sum  # prefix-cache hits are not computed
    assert delta(after, "vllm:iteration_tokens_total_sum", **m) == batch
    # The gateway's per-key accounting (no key configured: "anonymous").
    key = {"api_key_name": "anonymous", **m}
    assert delta(after, "npugw_api_key_requests_total", **key) == 3
    assert delta(after, "npugw_api_key_tokens_total", type="prompt", **key) == prompt_sum
    assert delta(after, "npugw_api_key_tokens_total", type="completion", **key) == completion_sum
    assert delta(after, "npugw_http_requests_total", route=CHAT_ROUTE, status="200") == 3


# ------------------------------------------------------------- queueing

@pytest.mark.asyncio
async def test_queue_depth_rises_while_requests_wait_and_drains(real_gateway: GatewayProcess) -> None:
    """20 concurrent streams on --max-num-seqs 8: 8 run, the rest wait in
    the gateway's queue (visible in npugw_queue_depth), then it drains to 0."""
    # 192 tokens: each wave of 8 runs ~5 s, so the queue stands ~10 s. With
    # 64 (waves of 1.7 s) CI's box once ran the three waves while this
    # process's loop got no turn for 3.9 s between two scrapes.
    n, max_tokens = 20, 192
    body = {
        "model": EMBEDDED,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as http:

        async def one() -> tuple[str, int]:
            last, completion = "", -1
            async with http.stream("POST", real_gateway.url + CHAT_ROUTE, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line[6:]
                        if last != "[DONE]":
                            usage = orjson.loads(last).get("usage")
                            if usage:
                                completion = usage["completion_tokens"]
            return last, completion

        tasks = [asyncio.ensure_future(one()) for _ in range(n)]
        seen: list[tuple[float, float, float]] = []  # (queue depth, vllm running, gateway running)
        both = False
        try:
            while not all(t.done() for t in tasks):
                text = (await http.get(real_gateway.url + "/metrics")).text
                depth = value(text, "npugw_queue_depth", model_name=EMBEDDED)  # summed over priority
                running = value(text, "vllm:num_requests_running", model_name=EMBEDDED)
                holding = value(text, "npugw_requests_running", model_name=EMBEDDED)
                seen.append((depth, running, holding))
                both = both or (depth >= 1 and running > 0)
                await asyncio.sleep(0.1)
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        assert results == [("[DONE]", max_tokens)] * n
        assert both, f"never saw queued and running requests in one scrape: {seen}"
        assert max(d for d, _, _ in seen) <= n - 8, seen
        assert max(h for _, _, h in seen) <= 8, seen  # never more than --max-num-seqs hold a slot
        assert max(r for _, r, _ in seen) <= 8, seen

        # Back to idle: nothing queued, nothing running.
        async def idle() -> bool:
            text = (await http.get(real_gateway.url + "/metrics")).text
            return (value(text, "npugw_queue_depth", model_name=EMBEDDED),
                    value(text, "vllm:num_requests_running", model_name=EMBEDDED)) == (0, 0)

        await wait_until(idle, timeout=60, what="no request queued or running", interval=0.2)
        text = (await http.get(real_gateway.url + "/metrics")).text
        assert value(text, "npugw_requests_running", model_name=EMBEDDED) == 0


# ---------------------------------------------------------------- promtool

# `promtool check metrics` lints names. vLLM's own names (kept on purpose, so
# vLLM dashboards work) break two lint rules: ':' is reserved for recording
# rules, and vLLM's histogram `vllm:iteration_tokens_total` ends in _total.
# These are lint findings (exit code 3), not errors (exit code 1).
_KNOWN_LINT = (
    re.compile(r"^(vllm:[a-z0-9_]+) metric names should not contain ':'$"),
    re.compile(r'^(vllm:iteration_tokens_total) non-counter metrics should not have "_total" suffix$'),
)


def _promtool_metrics(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


def test_promtool_check_metrics_on_the_live_page(real_gateway: GatewayProcess) -> None:
    chat(real_gateway, "Say hi.", max_tokens=4)  # histograms and key counters have samples
    text = scrape(real_gateway)
    r = _promtool_metrics(text)
    out = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode in (0, 3), out  # 1 would be a parse/consistency error
    flagged: set[str] = set()
    for line in out:
        m = next((p.match(line) for p in _KNOWN_LINT if p.match(line)), None)
        assert m is not None, f"unexpected promtool finding: {line!r} (all: {out})"
        flagged.add(m.group(1))
    assert (r.returncode == 3) == bool(out)
    # Only vLLM's names are flagged, never the gateway's or the seed's own.
    assert all(name.startswith("vllm:") for name in flagged)
    # With ':' replaced, only the _total histogram is left: no other problem hides behind the colon lints.
    r2 = _promtool_metrics(text.replace("vllm:", "vllm_"))
    out2 = [ln for ln in (r2.stdout + r2.stderr).splitlines() if ln.strip()]
    assert out2 == ['vllm_iteration_tokens_total non-counter metrics should not have "_total" suffix'], out2
    # The check can fail: a broken page is an error (exit 1), not a lint.
    r3 = _promtool_metrics(text + 'npugw_broken{a="1" 3\n')
    assert r3.returncode == 1 and "parsing error" in r3.stdout + r3.stderr


# -------------------------------------------------------------- Prometheus

def _query(client: httpx.Client, base: str, expr: str) -> list[dict[str, Any]]:
    r = client.get(f"{base}/api/v1/query", params={"query": expr})
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    assert body["data"]["resultType"] == "vector", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _wait_query(
    client: httpx.Client, base: str, expr: str, ok: Callable[[list[dict[str, Any]]], bool], timeout: float = 60
) -> list[dict[str, Any]]:
    seen: list[list[dict[str, Any]]] = []

    def holds() -> bool:
        seen.append(_query(client, base, expr))
        return ok(seen[-1])

    wait_until_sync(holds, timeout=timeout, what=lambda: f"{expr} (last result: {seen[-1:]})", interval=0.5)
    return seen[-1]


def test_real_prometheus_scrapes_the_real_gateway(
    real_gateway: GatewayProcess, npu_fixture_gateway: GatewayProcess, prometheus_server: StartPrometheus
) -> None:
    real = f"127.0.0.1:{real_gateway.port}"
    npu = f"127.0.0.1:{npu_fixture_gateway.port}"
    # deploy/prometheus/prometheus.yml: only targets and intervals changed;
    # the deploy rules.yml beside it.
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    # 2 s scrape timeout: on a loaded 2-core box a 1 s scrape can time out
    config["global"].update(scrape_interval="2s", evaluation_interval="1s", scrape_timeout="2s")
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    jobs["npu-gateway"]["static_configs"][0]["targets"] = [real, npu]
    jobs["prometheus"]["static_configs"][0]["targets"] = ["127.0.0.1:__PORT__"]
    _proc, port = prometheus_server(yaml.safe_dump(config), files={"rules.yml": (PROM_DIR / "rules.yml").read_text()})
    base = f"http://127.0.0.1:{port}"

    def at(instance: str, result: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [s for s in result if s["metric"].get("instance") == instance]

    with httpx.Client(timeout=15) as client:
        _wait_query(
            client, base, 'count_over_time(up{job="npu-gateway"}[1m]) >= 2', lambda r: len(r) == 2, timeout=90
        )
        up = _wait_query(client, base, 'up{job="npu-gateway"} == 1', lambda r: len(r) == 2, timeout=60)
        assert {s["metric"]["instance"]: s["value"][1] for s in up} == {real: "1", npu: "1"}

        # Real traffic between scrapes, so the rate below is of real tokens.
        chat(real_gateway, "Name a colour.", max_tokens=8)

        # The seed deployment's three expressions.
        running = _query(client, base, "vllm_num_running_requests")
        assert {s["metric"]["model_name"] for s in at(real, running)} >= {EMBEDDED}
        rate = _wait_query(
            client,
            base,
            "rate(vllm_batch_tokens_processed_total[1m])",
            lambda r: any(s["metric"]["model_name"] == EMBEDDED and float(s["value"][1]) > 0 for s in at(real, r)),
        )
        assert all(float(s["value"][1]) >= 0 for s in rate)
        # The seed's alert expression, verbatim: it evaluates. (On this CPU
        # box the real gateway has no NPU series. Note that even the
        # fixture-fed NPU replica's series give nothing here: `/` matches on
        # all labels and `type` differs, which is why rules.yml uses
        # `ignoring(type)`.)
        seed_alert = 'npu_memory_usage_bytes{type="used"} / npu_memory_usage_bytes{type="total"} > 0.8'
        assert _query(client, base, seed_alert) == []
        # The deployed alert's form pairs used with total per device: every
        # device of the recorded 16-NPU output is ~90% full; none on the CPU replica.
        alert = 'npu_memory_usage_bytes{type="used"} / ignoring(type) npu_memory_usage_bytes{type="total"} > 0.8'
        high = _query(client, base, alert)
        assert at(real, high) == []
        assert sorted(int(s["metric"]["device"]) for s in at(npu, high)) == list(range(16))
        assert all(0.8 < float(s["value"][1]) < 1 for s in high)
        # The same ratio over a series that exists on CPU.
        ratio = _query(
            client,
            base,
            'npugw_device_memory_bytes{type="used"} / ignoring(type) npugw_device_memory_bytes{type="total"}',
        )
        mine = at(real, ratio)
        assert {(s["metric"]["kind"], s["metric"]["device"]) for s in mine} >= {("cpu", "0"), ("process", "gateway")}
        assert all(0 < float(s["value"][1]) <= 1 for s in mine), mine

        # The deploy rules are loaded and evaluate cleanly.
        deploy_groups = {g["name"] for g in yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"]}

        def rules_ok(_: object = None) -> bool:
            groups = client.get(f"{base}/api/v1/rules").json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return (
                {g["name"] for g in groups} == deploy_groups
                and bool(rules)
                and all(r.get("health") == "ok" and r.get("lastEvaluation", "").startswith("20") for r in rules)
            )

        wait_until_sync(rules_ok, timeout=30, what="every rule loaded, healthy and evaluated", interval=0.5)
        # ... and NPUMemoryHigh is pending (for: 5m) on every device of the NPU replica only.
        def memory_alerts() -> list[dict[str, Any]]:
            alerts = client.get(f"{base}/api/v1/alerts").json()["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "NPUMemoryHigh"]

        wait_until_sync(lambda: len(memory_alerts()) >= 16, timeout=30, what="16 NPUMemoryHigh alerts", interval=0.5)
        mem = memory_alerts()
        assert {(a["labels"]["instance"], a["state"]) for a in mem} == {(npu, "pending")}
        assert sorted(int(a["labels"]["device"]) for a in mem) == list(range(16))


# ----------------------------------------------------------------- Grafana

def test_every_dashboard_metric_is_exported_by_real_code(
    real_gateway: GatewayProcess, npu_fixture_gateway: GatewayProcess
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used: dict[str, set[str]] = {}
    for title, expr in panel_exprs(dashboard["panels"]):
        for name in metric_names_in_promql(expr):
            used.setdefault(name, set()).add(title)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            for name in grafana_query_metric_names(query):
                used.setdefault(name, set()).add(f"variable ${var['name']}")
    assert len(used) >= 20 and NPU_ONLY <= set(used)

    # The NPU-only names: exported by the gateway's device collector when
    # npu-smi reports NPUs (the recorded output, through the real NpuSmiProbe).
    npu_text = scrape(npu_fixture_gateway)
    npu_live = sample_names(npu_text)
    assert NPU_ONLY <= npu_live, NPU_ONLY - npu_live
    assert metric_value(npu_text, "npu_memory_usage_bytes", type="total", device="15") == 65536 * 1024 * 1024
    assert metric_value(npu_text, "npu_health") == 16  # 16 devices, all "OK"

    # Everything else: exported by the real-engine gateway itself. Compared
    # with sample names, so a family that is declared (# HELP / # TYPE) but
    # has no sample counts as missing: Prometheus would store no series, and
    # the panel would show "No data".
    chat(real_gateway, "Say hi.", max_tokens=4)  # every per-request family has samples
    live = sample_names(scrape(real_gateway))
    missing = {name: sorted(where) for name, where in used.items() if name not in live and name not in NPU_ONLY}
    assert not missing, f"dashboard metrics the real gateway does not export: {missing}"
