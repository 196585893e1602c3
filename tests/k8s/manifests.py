"""Reading the rendered k8s/ manifests: shared by tests/k8s and tests/integration/test_k8s_service.py."""
from __future__ import annotations

from pathlib import Path

import promql_parser
import yaml

from tests.k8s.kustomize import build

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-dev", "gpu-prod")
KUBELET_METRICS = {"kubelet_volume_stats_available_bytes", "kubelet_volume_stats_capacity_bytes"}  # the kubelet's, which
# a Kubernetes Prometheus stack scrapes: the snapshot volume's space
RAY_SERVE_METRICS = {"ray_serve_num_http_requests_total"}  # Ray Serve's own (Ray's metrics port) that alerts read:
# test_manifests checks that the installed Ray defines them; the service's /metrics does not show them


def rendered(overlay: str) -> list[dict]:
    """The resources of k8s/overlays/<overlay>, rendered."""
    return build(K8S / "overlays" / overlay)


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    found = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def groups(rayservice: dict) -> dict[str, dict]:
    """Pod groups by name: 'head' and each worker group's groupName."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}}


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def alert_exprs(resources: list[dict]) -> dict[str, str]:
    rule = one(resources, "PrometheusRule")
    return {r.get("alert") or r["record"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def grafana_exprs(dashboard: dict) -> list[str]:
    """PromQL of every panel target, with Grafana's variables replaced by values PromQL parses."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return [e.replace("$__rate_interval", "5m") for e in exprs]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a parse error raises)."""
    names = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        elif isinstance(node, promql_parser.MatrixSelector) and node.vector_selector.name:
            names.add(node.vector_selector.name)
    promql_parser.walk(promql_parser.parse(expr), visit)
    return names
