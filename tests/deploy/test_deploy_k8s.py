"""deploy/k8s: every kustomization rendered with `kubectl kustomize`, every
standard object validated offline and strictly against the Kubernetes
OpenAPI schemas (kubernetes-validate), the ServiceMonitor CRD object against
a schema of the fields used, and the manifests checked against each other
and against the gateway's settings."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/production", "overlays/ascend310p"]
# Oldest and newest Kubernetes minors the manifests are checked against.
K8S_VERSIONS = ["1.27.0", "1.37.0"]
CRD_KINDS = {"ServiceMonitor"}

# `npu-gateway serve` flags (each also NPUGW_<FLAG>), plus env-only settings.
GATEWAY_FLAGS = {
    "host", "port", "model", "served-model-name", "api-key", "backend", "num-workers", "max-queue-size",
    "max-queue-wait", "request-timeout", "shutdown-timeout", "sse-keep-alive-interval", "max-request-body-bytes",
    "readiness-interval", "tensor-parallel-size", "pipeline-parallel-size", "distributed-executor-backend",
    "max-model-len", "dtype", "enforce-eager", "max-num-seqs", "max-num-batched-tokens", "block-size",
    "enable-prefix-caching", "gpu-memory-utilization", "profile-dir", "state-url", "state-fail",
}
GATEWAY_ENV = {"NPUGW_" + f.upper().replace("-", "_") for f in GATEWAY_FLAGS} | {"NPUGW_CACHE_DIR"}

_DURATION = r"^(0|([0-9]+(ms|s|m|h))+)$"
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


def render(kustomization: str, kubectl: str) -> list[dict[str, Any]]:
    r = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request: pytest.FixtureRequest, kubectl_binary: str) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param, kubectl_binary)


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


# ------------------------------------------------------------ validation

def test_standard_objects_validate_strictly(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor"} <= kinds, name
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            kv.validate(doc, version, strict=True)


def test_crd_objects_validate(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Every CRD object is validated, and there is one to validate: a
    kustomization that rendered none would pass the loop vacuously."""
    name, docs = rendered
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    assert [d["kind"] for d in crds] == ["ServiceMonitor"], name
    for doc in crds:
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)


def test_validation_can_fail(kubectl_binary: str) -> None:
    docs = render("base", kubectl_binary)
    dep = one(docs, "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSIONS[-1], strict=True)
    sm = one(docs, "ServiceMonitor")
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)


def test_the_raw_files_parse_with_kind_and_name() -> None:
    files = sorted(f for f in K8S.rglob("*.yaml") if f.name != "values.yaml")  # values.yaml: Helm values
    assert len(files) >= 10
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc and doc.get("apiVersion") and doc.get("kind"), f
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], f


# ---------------------------------------------------------- consistency

def test_shutdown_timing_is_consistent(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _name, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = int(pre_stop[1])
    shutdown = int(one(docs, "ConfigMap")["data"]["NPUGW_SHUTDOWN_TIMEOUT"])
    grace = int(pod["terminationGracePeriodSeconds"])
    assert (sleep, shutdown, grace) == (10, 60, 90)
    # preStop, then the drain, then at least 10 s for the engine to let go.
    assert grace >= sleep + shutdown + 10


def test_probes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _name, docs = rendered
    c = container(docs)
    port_names = {p["name"] for p in c["ports"]}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] in port_names
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 600, "slow model loads"
    (port,) = c["ports"]
    assert port["containerPort"] == int(one(docs, "ConfigMap")["data"]["NPUGW_PORT"]) == 8000


def test_npu_resources_and_host_mounts(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    c = container(docs)
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    npu = [k for k in limits if k.startswith("huawei.com/Ascend")]
    assert len(npu) == 1, limits
    assert requests[npu[0]] == limits[npu[0]]
    data = one(docs, "ConfigMap")["data"]
    tp = int(data.get("NPUGW_TENSOR_PARALLEL_SIZE", "1"))
    pp = int(data.get("NPUGW_PIPELINE_PARALLEL_SIZE", "1"))
    assert int(limits[npu[0]]) == tp * pp
    expected = {"base": "huawei.com/Ascend910", "overlays/production": "huawei.com/Ascend910",
                "overlays/ascend310p": "huawei.com/Ascend310P"}[name]
    assert npu[0] == expected
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["accelerator"] == "huawei-" + expected.split("/")[1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in ("/usr/local/Ascend/driver", "/usr/local/bin/npu-smi", "/usr/local/dcmi", "/etc/ascend_install.info"):
        mount = mounts[path]
        assert mount.get("readOnly") is True, path
        assert volumes[mount["name"]]["hostPath"]["path"] == path
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"


def test_objects_point_at_each_other(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _name, docs = rendered
    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    svc = one(docs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    c = container(docs)
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in {p["name"] for p in c["ports"]}
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert all(e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "npugw_queue_depth"
    cm = one(docs, "ConfigMap")
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in c["envFrom"]
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert len(namespaces) == 1


def test_settings_are_gateway_settings(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _name, docs = rendered
    data = one(docs, "ConfigMap")["data"]
    assert set(data) <= GATEWAY_ENV, set(data) - GATEWAY_ENV
    assert all(isinstance(v, str) for v in data.values())
    assert data["NPUGW_MAX_REQUEST_BODY_BYTES"] == "4194304"
    assert data["NPUGW_SSE_KEEP_ALIVE_INTERVAL"] == "15"
    env = {e["name"] for e in container(docs).get("env", [])}
    assert env <= GATEWAY_ENV


def test_pod_security_matches_the_image(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _name, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True
    users = re.findall(r"^USER\s+(\d+)", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert users and {int(u) for u in users} == {sc["runAsUser"]}
    assert pod["enableServiceLinks"] is False
    c = container(docs)
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_production_overlay(kubectl_binary: str) -> None:
    docs = render("overlays/production", kubectl_binary)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"npu-gateway"}
    c = container(docs)
    assert c["image"] == "registry.example.com/ai/npu-gateway:0.1.0-npu"
    data = one(docs, "ConfigMap")["data"]
    assert data["NPUGW_MODEL"].startswith("/models/")
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == mounts["/models"]["name"])["persistentVolumeClaim"]
    assert claim["claimName"] == one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    assert one(docs, "ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The base's settings survive the overlay's ConfigMap patch.
    assert data["NPUGW_SHUTDOWN_TIMEOUT"] == "60"


def test_ascend310p_overlay_has_no_910_left(kubectl_binary: str) -> None:
    text = yaml.safe_dump_all(render("overlays/ascend310p", kubectl_binary))
    assert "Ascend910" not in text
    assert "huawei.com/Ascend310P" in text


# ---------------------------------------------------- prometheus-adapter

def test_prometheus_adapter_example() -> None:
    adapter = K8S / "prometheus-adapter"
    cm = yaml.safe_load((adapter / "rules-configmap.yaml").read_text())
    for version in K8S_VERSIONS:
        kv.validate(cm, version, strict=True)
    config = yaml.safe_load(cm["data"]["config.yaml"])
    values = yaml.safe_load((adapter / "values.yaml").read_text())
    assert config["rules"] == values["rules"]["custom"]
    assert config["externalRules"] == values["rules"]["external"]
    (pods_rule,) = config["rules"]
    assert pods_rule["name"]["as"] == "npugw_queue_depth"
    assert set(pods_rule["resources"]["overrides"]) == {"namespace", "pod"}
    for rule in config["rules"] + config["externalRules"]:
        assert rule["seriesQuery"].startswith("npugw_queue_depth{")
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_valkey_for_shared_limits(kubectl_binary: str) -> None:
    """deploy/k8s/valkey renders and validates; the gateway's NPUGW_STATE_URL
    names its Service and port, and is a URL the gateway accepts."""
    from urllib.parse import urlsplit

    from server.state_url import check_state_url

    docs = render("valkey", kubectl_binary)
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]
    for doc in docs:
        for version in K8S_VERSIONS:
            kv.validate(doc, version, strict=True)
    dep, svc = one(docs, "Deployment"), one(docs, "Service")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    url = one(render("base", kubectl_binary), "ConfigMap")["data"]["NPUGW_STATE_URL"]
    check_state_url(url)
    parts = urlsplit(url)
    assert parts.hostname == svc["metadata"]["name"]
    assert parts.port in {p["port"] for p in svc["spec"]["ports"]}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert {p["name"] for p in c["ports"]} == {svc["spec"]["ports"][0]["targetPort"]}
