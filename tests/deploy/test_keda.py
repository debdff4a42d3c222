"""deploy/k8s/keda: the ScaledObject scales the base Deployment on a metric
the gateway exports (server/queueing.py), by the name it exports it under."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from engine_adapter.backends.simulated import SimulatedEngine
from engine_adapter.pool import WorkerPool
from server.queueing import QueueCollector

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def test_scaled_object_targets_the_deployment_on_an_exported_gauge() -> None:
    so = yaml.safe_load((K8S / "keda" / "scaledobject.yaml").read_text())
    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    assert so["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    names = set(re.findall(r"npugw_[a-z_]+", trigger["metadata"]["query"]))
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: [WorkerPool("m", lambda i: SimulatedEngine())]))
    exported = {m.name for m in registry.collect()}
    assert names and names <= exported, (names, exported)
