"""The service as the cpu-dev Kubernetes overlay configures it, on the session's local Ray (2 CPUs) and
redis-server: the Serve config is the overlay's rendered spec.serveConfigV2, deployed the way KubeRay
deploys it (the dashboard's PUT /api/serve/applications/ handler: serve_start with the config's options, which
finds the session's Serve running on the same HTTP host and port, as a cluster's dashboard finds it after the first
deploy, then deploy_apps), with the replicas reading REDIS_URL and the write token from their environment as the
pods do from the Secret. Only what a laptop cannot give is changed: the HTTP host and port, and the snapshot
directory. Then: it answers, and every metric the k8s/ alerts and dashboard name is in its /metrics."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import redis
import requests
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.serving import load_scorer
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request
from deployments.config import APP_NAME, ServiceConfig
from index_updater.publisher import Publisher
from tests.k8s.manifests import (KUBELET_METRICS, RAY_SERVE_METRICS, alert_exprs, grafana_exprs, metric_names, one,
                                  rendered, serve_config)

READY_TIMEOUT_S = 240


def local_copy(config: dict, port: int, snapshot_dir: Path) -> dict:
    """The overlay's Serve config with the HTTP host/port and snapshot directory of this machine."""
    local = copy.deepcopy(config)
    local["http_options"] = {**local["http_options"], "host": "127.0.0.1", "port": port}
    local["applications"][0]["args"]["snapshot_dir"] = str(snapshot_dir)
    return local


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            reply = requests.get(f"{url}/readyz", timeout=5)
            if reply.status_code == 200:
                return
            last = reply.text
        except requests.RequestException as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise AssertionError(f"not ready after {timeout_s} s: {last}; serve status: {serve.status()}")


@pytest.fixture(scope="module")
def cpu_dev(tmp_path_factory, session_redis_url, ray_serve):
    tmp, url = tmp_path_factory.mktemp("k8s-cpu-dev"), session_redis_url
    overlay_config = serve_config(one(rendered("cpu-dev"), "RayService"))
    service = ServiceConfig.model_validate(overlay_config["applications"][0]["args"])
    world = tmp / "world"
    base_time = (int(time.time()) // 86400 + 12) * 86400  # every window still open while the test runs
    synthesize(WorldConfig(ads=400, users=10, seed=11, base_time=base_time), world, load_schema())
    schema = load_schema(service.schema_path)
    scorer = load_scorer(service.model, schema)
    Publisher(redis.Redis.from_url(url), schema, scorer, shards=service.shards,
              stream=service.stream).publish_file(world / "events.jsonl")
    # The workers read REDIS_URL (this Redis) and the write token from their environment (ray_serve), as the pods do
    # from the Secret; the config names no redis_url.
    config = ServeDeploySchema.model_validate(local_copy(overlay_config, urlsplit(ray_serve).port, tmp / "snapshots"))
    client = serve_start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location,
                         grpc_options=config.grpc_options.model_dump(), global_logging_config=config.logging_config,
                         controller_options=config.controller_options)
    try:
        client.deploy_apps(config)
        wait_ready(ray_serve, READY_TIMEOUT_S)
        yield SimpleNamespace(url=ray_serve, world=world, service=service, schema=schema, scorer=scorer,
                              overlay_config=overlay_config, deployed=config)
    finally:
        serve.delete(APP_NAME)


def post(url: str, body) -> requests.Response:
    return requests.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=30)


def test_only_the_machine_specific_fields_differ_from_the_overlay(cpu_dev):
    local = local_copy(cpu_dev.overlay_config, 1234, Path("/elsewhere"))
    local["http_options"] = cpu_dev.overlay_config["http_options"]
    local["applications"][0]["args"]["snapshot_dir"] = cpu_dev.service.snapshot_dir
    assert local == cpu_dev.overlay_config
    status = serve.status().applications[APP_NAME]
    assert status.status == "RUNNING"
    assert set(status.deployments) == {"router", *(f"shard-{s}" for s in range(cpu_dev.service.shards))}


def test_the_cpu_dev_service_answers_as_the_offline_retriever(cpu_dev):
    index = AdIndex(cpu_dev.schema, cpu_dev.scorer.dim)
    load_events(index, cpu_dev.schema, cpu_dev.scorer, read_events(cpu_dev.world / "events.jsonl"))
    offline = Retriever(index, cpu_dev.scorer, rescore=cpu_dev.service.rescore)
    answered = 0
    for line in (cpu_dev.world / "requests.jsonl").read_text().splitlines()[:5]:
        body = {**json.loads(line), "k": 20}
        got = post(f"{cpu_dev.url}/v1/retrieve", body)
        assert got.status_code == 200, got.text
        want = offline.retrieve([parse_request(body)])[0]
        assert [a["ad_id"] for a in got.json()["ads"]] == [a.ad_id for a in want.ads]
        assert len(got.json()["shard_watermarks"]) == cpu_dev.service.shards
        answered += bool(want.ads)
    assert answered  # not every answer empty


def test_the_metrics_the_alerts_and_dashboard_name_are_exported(cpu_dev):
    """Compared with a scrape of this running service, after traffic of every kind the metrics count."""
    body = {**json.loads((cpu_dev.world / "requests.jsonl").read_text().splitlines()[0]), "k": 5}
    assert post(f"{cpu_dev.url}/v1/retrieve", body).status_code == 200
    assert post(f"{cpu_dev.url}/v1/retrieve:batch", [body, body]).status_code == 200
    assert post(f"{cpu_dev.url}/v1/retrieve", {"user": {"user_id": -1}}).status_code == 422  # counts an error
    scrape = requests.get(f"{cpu_dev.url}/metrics", timeout=10)
    assert scrape.status_code == 200
    exported = {line.split("{")[0].split(" ")[0] for line in scrape.text.splitlines() if line and not line.startswith("#")}
    named = set()
    for overlay in ("cpu-dev", "gpu-prod"):
        resources = rendered(overlay)
        dashboard = json.loads(one(resources, "ConfigMap", "andromeda-grafana-dashboard")["data"]["andromeda.json"])
        for expr in [*alert_exprs(resources).values(), *grafana_exprs(dashboard)]:
            named |= metric_names(expr)
    assert len(named) >= 15
    assert named - exported == RAY_SERVE_METRICS | KUBELET_METRICS  # on Ray's metrics port (tests/k8s checks Ray
    # defines them), and the kubelet's (the snapshot volume's space)
    ready = [line for line in scrape.text.splitlines() if line.startswith("andromeda_shard_ready{")]
    assert len(ready) == cpu_dev.service.shards and all(line.endswith(" 1.0") for line in ready)
