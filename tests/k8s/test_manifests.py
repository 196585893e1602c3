"""Offline validation of k8s/ (no cluster): every file parses, both overlays render (tests.k8s.kustomize),
built-in kinds and the RayService's pod templates validate against the Kubernetes schemas
(kubernetes-validate, strict), the RayService and the Prometheus Operator resources against schemas written
for the fields they use, serveConfigV2 against Ray's own Serve config schema and against the overlay's
ServiceConfig (regenerated: a stale patch fails), and the PromQL of the alerts and the dashboard parses and
names only metrics the service exports. tests/integration/test_k8s_service.py runs the cpu-dev config."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import torch
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from andromeda_cli.k8s import PATCH_FILE, overlay_config, serve_config_patch
from andromeda_cli.main import main
from andromeda_core.quantization import ROW_ALIGN, aligned_rows
from deployments.config import ROUTER, SERVE_ENV, ServiceConfig
from deployments.metrics import ServiceMetrics
from index_updater import snapshots
from tests.k8s.kustomize import build
from tests.k8s.manifests import (K8S, KUBELET_METRICS, OVERLAYS, RAY_SERVE_METRICS, ROOT, alert_exprs, grafana_exprs, groups, metric_names, one,
                                  serve_config)

K8S_VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes we support (matchLabelKeys in topology spread) and the newest schema shipped
BUILTIN_GROUPS = {"", "apps", "policy", "networking.k8s.io"}
SECRET_ENV = {"REDIS_URL", "ANDROMEDA_WRITE_TOKEN", "REDIS_PASSWORD", "REDISCLI_AUTH"}


def load_capacity_model():
    """scripts/capacity_model.py (scripts/ is not a package)."""
    if "capacity_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("capacity_model", ROOT / "scripts" / "capacity_model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["capacity_model"] = module  # its dataclasses look their module up while they are built
        spec.loader.exec_module(module)
    return sys.modules["capacity_model"]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, build(K8S / "overlays" / request.param)


def schema(name: str) -> dict:
    return json.loads((K8S / "schemas" / f"{name}.schema.json").read_text())


def quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units.get(unit, 1)


# -- files and rendering -------------------------------------------------------------------------------------


def test_every_manifest_file_parses():
    files = [p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    assert len(files) >= 15
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
            assert docs, f"{path} is empty"


def test_overlays_render_the_whole_service(overlay):
    name, resources = overlay
    kinds = sorted(r["kind"] for r in resources)
    expected = ["ConfigMap", "ConfigMap", "Ingress", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget",
                "PodMonitor", "PodMonitor", "PrometheusRule", "RayService", "Service", "Service", "StatefulSet"]
    if name == "gpu-prod":
        expected += ["PersistentVolumeClaim", "PodDisruptionBudget"]
    assert kinds == sorted(expected)
    namespace = {"cpu-dev": "andromeda-dev", "gpu-prod": "andromeda"}[name]
    assert all(r["metadata"]["namespace"] == namespace for r in resources)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_against_the_kubernetes_schemas(overlay, version):
    _, resources = overlay
    builtin = [r for r in resources if r["apiVersion"].rpartition("/")[0] in BUILTIN_GROUPS]
    assert len(builtin) >= 7
    for resource in builtin:
        kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_rayservice_pod_templates_validate_as_kubernetes_pod_templates(overlay, version):
    _, resources = overlay
    for group, spec in groups(one(resources, "RayService")).items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group},
                                      "template": spec["template"]}, version, strict=True)


def test_strict_validation_would_catch_a_misspelt_field(overlay):
    _, resources = overlay
    statefulset = one(resources, "StatefulSet")
    broken = {**statefulset, "spec": {**statefulset["spec"], "replica": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_custom_resources_match_the_schemas_written_for_them(overlay):
    _, resources = overlay
    for kind, name in (("RayService", "rayservice"), ("PodMonitor", "podmonitor"), ("PrometheusRule", "prometheusrule")):
        checked = [r for r in resources if r["kind"] == kind]
        assert checked
        for resource in checked:
            jsonschema.validate(resource, schema(name), cls=jsonschema.Draft202012Validator)
    rayservice = one(resources, "RayService")
    bad = json.loads(json.dumps(rayservice))
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2  # KubeRay takes strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema("rayservice"), cls=jsonschema.Draft202012Validator)


def test_worker_group_bounds_are_ordered(overlay):
    _, resources = overlay
    for name, group in groups(one(resources, "RayService")).items():
        if name != "head":
            assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


# -- the Serve config ------------------------------------------------------------------------------------


def models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (Optional[X], List[X], Union[X, str], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in models_in(arg)]


def unknown_keys(data: dict, model: type[BaseModel], where: str = "") -> list[str]:
    """Keys Ray's schema would silently ignore (its models allow extra fields), recursively."""
    found = []
    for key, value in data.items():
        if key not in model.model_fields:
            found.append(f"{where}{key}")
            continue
        models = models_in(model.model_fields[key].annotation)
        if models and isinstance(value, dict):
            found += unknown_keys(value, models[0], f"{where}{key}.")
        elif models and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found += unknown_keys(item, models[0], f"{where}{key}[{i}].")
    return found


def test_serve_config_v2_validates_with_rays_own_schema(overlay):
    name, resources = overlay
    config = serve_config(one(resources, "RayService"))
    parsed = ServeDeploySchema.model_validate(config)
    assert unknown_keys(config, ServeDeploySchema) == []
    app = parsed.applications[0]
    assert app.import_path == "deployments.app:app_builder" and app.route_prefix == "/"
    assert parsed.http_options.host == "0.0.0.0" and parsed.http_options.port == 8000
    service = ServiceConfig.model_validate(app.args)
    assert [d.name for d in app.deployments] == ["router"] + [f"shard-{s}" for s in range(service.shards)]


def test_unknown_keys_finds_what_ray_would_ignore():
    config = ServiceConfig().to_serve_config()
    config["applications"][0]["deployments"][0]["num_replica"] = 2
    assert unknown_keys(config, ServeDeploySchema) == ["applications[0].deployments[0].num_replica"]


def test_serve_config_v2_is_the_overlays_service_config(overlay):
    name, resources = overlay
    expected = overlay_config(K8S / "overlays" / name)
    assert serve_config(one(resources, "RayService")) == expected.to_serve_config()
    assert "redis_url" not in serve_config(one(resources, "RayService"))["applications"][0]["args"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_generated_patch_is_up_to_date(name):
    """Fails when service.yaml changed and `andromeda k8s-config` was not run."""
    directory = K8S / "overlays" / name
    assert (directory / PATCH_FILE).read_text() == serve_config_patch(overlay_config(directory))


def test_k8s_config_check_names_a_stale_overlay(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["k8s-config", "--check"]) == 0
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "service.yaml").write_text("shards: 3\n")
    (stale / PATCH_FILE).write_text((K8S / "overlays" / "cpu-dev" / PATCH_FILE).read_text())
    with pytest.raises(SystemExit) as done:
        main(["k8s-config", "--check", str(stale)])
    assert done.value.code == 1 and str(stale / PATCH_FILE) in capsys.readouterr().err
    assert main(["k8s-config", str(stale)]) == 0
    assert yaml.safe_load(yaml.safe_load((stale / PATCH_FILE).read_text())[0]["value"])["applications"][0]["args"]["shards"] == 3


def test_k8s_config_refuses_a_redis_url_in_the_overlay(tmp_path, capsys):
    (tmp_path / "service.yaml").write_text("redis_url: redis://:secret@redis:6379/0\n")
    assert main(["k8s-config", str(tmp_path)]) == 2
    assert "redis_url" in capsys.readouterr().err and not (tmp_path / PATCH_FILE).exists()


def test_k8s_config_writes_no_overlay_when_one_is_bad(tmp_path, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for overlay, text in ((good, "shards: 2\n"), (bad, 'shards: "x"\n')):
        overlay.mkdir()
        (overlay / "service.yaml").write_text(text)
    assert main(["k8s-config", str(good), str(bad)]) == 2
    assert "shards" in capsys.readouterr().err and not (good / PATCH_FILE).exists()


# -- the pods -------------------------------------------------------------------------------------------------


def containers(resources: list[dict]) -> list[tuple[str, dict]]:
    """(where, container) of every pod template: the RayService's groups and the StatefulSet."""
    found = [(group, c) for group, spec in groups(one(resources, "RayService")).items()
             for c in spec["template"]["spec"]["containers"]]
    found += [("redis", c) for c in one(resources, "StatefulSet")["spec"]["template"]["spec"]["containers"]]
    return found


def test_every_container_has_requests_and_limits(overlay):
    _, resources = overlay
    for where, container in containers(resources):
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and \
            {"cpu", "memory"} <= set(container["resources"]["limits"]), where


def test_credentials_come_only_from_secrets(overlay):
    _, resources = overlay
    assert not [r for r in resources if r["kind"] == "Secret"]  # created out of band (docs/operations.md)
    for where, container in containers(resources):
        for env in container.get("env", []):
            if env["name"] in SECRET_ENV:
                assert "value" not in env and env["valueFrom"]["secretKeyRef"]["name"] == "andromeda-secrets", where
    text = yaml.safe_dump([r for r in resources if r["kind"] == "ConfigMap"]) + one(resources, "RayService")["spec"]["serveConfigV2"]
    assert not re.search(r"requirepass\s+\S*[A-Za-z0-9]{6}|redis://[^\s@]*:[^\s@]+@|write[-_]token\s*[:=]\s*\S", text)


def test_the_ray_cluster_wants_a_token_and_the_image_installs_the_tested_versions(overlay):
    """Without token authentication any pod that reaches the head's dashboard could submit a job: code on the cluster,
    reading REDIS_URL and the write token from a worker's environment. The image installs with constraints-cpu.txt,
    which the two commands install with (but triton's pin: a CUDA torch requires its own)."""
    _, resources = overlay
    assert one(resources, "RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    dockerfile = (K8S / "image" / "Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^COPY .*\bconstraints-cpu\.txt\b", dockerfile, re.M)
    assert re.search(r"grep -v '\^triton==' constraints-cpu\.txt > (\S+) .*pip install --no-cache-dir -c \1 \.",
                     dockerfile)


def image_env() -> dict[str, str]:
    """The ENV instructions of k8s/image/Dockerfile (NAME=value pairs, lines joined at backslashes)."""
    text = (K8S / "image" / "Dockerfile").read_text().replace("\\\n", " ")
    return dict(pair.split("=", 1) for line in re.findall(r"^ENV (.+)$", text, re.M) for pair in line.split())


def test_the_image_sets_the_services_ray_serve_settings_and_no_pod_overrides_them(overlay):
    assert image_env() == SERVE_ENV
    _, resources = overlay
    for where, container in containers(resources):
        assert not {env["name"] for env in container.get("env", [])} & set(SERVE_ENV), where


def test_workers_probe_readyz_and_healthz_and_the_head_keeps_kuberays_probes(overlay):
    _, resources = overlay
    # so the head, which /readyz does not gate, stays out of the serve Service the Ingress sends traffic to
    assert one(resources, "RayService")["spec"]["excludeHeadPodFromServeSvc"] is True
    for name, group in groups(one(resources, "RayService")).items():
        container = group["template"]["spec"]["containers"][0]
        if name == "head":  # KubeRay deploys the app only once the head is ready
            assert "readinessProbe" not in container and "livenessProbe" not in container
            continue
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "serve"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/-/healthz", "port": "serve"}  # no router queue
        liveness = container["livenessProbe"]  # a pod left with no replica (its proxy drained: 503) goes before it
        idle = one(resources, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]["idleTimeoutSeconds"]
        assert idle < liveness["periodSeconds"] * liveness["failureThreshold"] - 30, name  # is restarted (30 s draining)
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert {"name": "serve", "containerPort": 8000} in container["ports"]


def test_each_worker_group_spreads_over_nodes_and_has_a_disruption_budget(overlay):
    _, resources = overlay
    budgets = [r for r in resources if r["kind"] == "PodDisruptionBudget"]
    for name, group in groups(one(resources, "RayService")).items():
        if name == "head":
            continue
        labels = {**group["template"]["metadata"]["labels"], "ray.io/group": name}  # KubeRay adds ray.io/group
        spread = group["template"]["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        assert all(c["labelSelector"]["matchLabels"].items() <= labels.items() for c in spread)
        [budget] = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
                    and b["spec"]["selector"]["matchLabels"].get("ray.io/group") == name]
        # a RayCluster's pods: Kubernetes computes a budget only from an integer minAvailable (no scale subresource);
        # all but one of the group's least pods, so a drain can always go on
        assert set(budget["spec"]) == {"minAvailable", "selector"}, name
        assert budget["spec"]["minAvailable"] == max(group["minReplicas"] - 1, 0), name


def test_the_device_kinds_get_their_worker_groups(overlay):
    name, resources = overlay
    rayservice = one(resources, "RayService")
    service = ServiceConfig.model_validate(serve_config(rayservice)["applications"][0]["args"])
    by_name = groups(rayservice)
    if name == "cpu-dev":
        assert service.device == "cpu" and set(by_name) == {"head", "cpu-workers"}
        pod_cpus = quantity(by_name["cpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        needed = service.router_replicas * service.router_cpus + service.shards * service.replicas * service.shard_cpus
        assert needed <= pod_cpus * by_name["cpu-workers"]["maxReplicas"]
        return
    assert service.device == "cuda" and set(by_name) == {"head", "cpu-workers", "gpu-workers"}
    gpu, cpu = by_name["gpu-workers"], by_name["cpu-workers"]
    resources_ = gpu["template"]["spec"]["containers"][0]["resources"]
    assert resources_["requests"]["nvidia.com/gpu"] == resources_["limits"]["nvidia.com/gpu"] == 1
    bounds = service.autoscaling
    assert (gpu["minReplicas"], gpu["maxReplicas"]) == (service.shards * bounds.min_replicas, service.shards * bounds.max_replicas)
    assert float(gpu["rayStartParams"]["num-cpus"]) == service.shard_cpus  # one shard replica per pod, no router
    assert cpu["minReplicas"] == cpu["maxReplicas"] == service.router_replicas
    assert float(cpu["rayStartParams"]["num-cpus"]) == service.router_cpus  # one router per pod (metrics, below)
    assert "nvidia.com/gpu" not in cpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    # routers only there: a GPU pod with no shard replica yet has a router's CPUs too, but no write token
    offered = {group: json.loads(json.loads(g["rayStartParams"].get("resources", '"{}"')))  # ray start --resources
               for group, g in by_name.items()}  # takes JSON, which KubeRay wants quoted once more
    assert service.router_resources and all(offered[g].get(r) is None for g in ("head", "gpu-workers")
                                            for r in service.router_resources)
    assert offered["cpu-workers"] == service.router_resources
    router = next(d for d in serve_config(rayservice)["applications"][0]["deployments"] if d["name"] == ROUTER)
    assert router["ray_actor_options"]["resources"] == service.router_resources


def test_snapshots_are_where_the_service_config_writes_them(overlay):
    name, resources = overlay
    rayservice = one(resources, "RayService")
    snapshot_dir = Path(serve_config(rayservice)["applications"][0]["args"]["snapshot_dir"])
    for group_name, group in groups(rayservice).items():
        if group_name == "head":
            continue
        spec = group["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert Path(mounts["snapshots"]) in [snapshot_dir, *snapshot_dir.parents]
    if name == "gpu-prod":
        claim = one(resources, "PersistentVolumeClaim", "andromeda-snapshots")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        gpu_volumes = {v["name"]: v for v in groups(rayservice)["gpu-workers"]["template"]["spec"]["volumes"]}
        assert gpu_volumes["snapshots"]["persistentVolumeClaim"]["claimName"] == "andromeda-snapshots"


def test_redis_keeps_an_append_only_file_on_its_volume_and_never_evicts(overlay):
    _, resources = overlay
    config = one(resources, "ConfigMap", "andromeda-redis-config")["data"]["redis.conf"]
    settings = dict(line.split(None, 1) for line in config.splitlines() if line.strip() and not line.startswith("#"))
    assert settings["appendonly"] == "yes" and settings["appendfsync"] in ("everysec", "always")
    assert settings["maxmemory-policy"] == "noeviction" and settings["dir"] == "/data"
    statefulset = one(resources, "StatefulSet", "andromeda-redis")
    mounts = {m["name"]: m["mountPath"] for m in statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data" and [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]] == ["data"]
    assert one(resources, "Service", "andromeda-redis-headless")["spec"]["clusterIP"] == "None"


def test_the_ingress_takes_the_bodies_the_service_takes_and_no_larger(overlay):
    """nginx's size is in MiB for "m" (a review found 16m over the service's 8 MiB: batches nginx passed got a 413)."""
    name, resources = overlay
    size = one(resources, "Ingress")["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"]
    number, unit = re.fullmatch(r"([0-9]+)([kmg]?)", size).groups()
    assert int(number) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit] == \
        overlay_config(K8S / "overlays" / name).limits.body_bytes


def test_the_proxy_error_alert_leaves_the_readiness_probes_out(overlay):
    """/readyz answers 503 while a shard is not ready, and the probes were most of a quiet namespace's traffic: the
    proxies' 5xx alert paged for what AndromedaShardNotReady covers (a review of the manifests)."""
    expr = alert_exprs(overlay[1])["AndromedaProxyErrorRate"]
    assert expr.count('route!="/readyz"') == 2


def test_ingress_sends_the_api_to_the_serve_service(overlay):
    _, resources = overlay
    serve_service = one(resources, "RayService")["spec"]["serveService"]
    ingress = one(resources, "Ingress")
    paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert {p["path"] for p in paths} == {"/v1", "/openapi.json"}  # not /metrics; no /docs (it would load a CDN)
    ports = {p["name"] for p in serve_service["spec"]["ports"]}
    for p in paths:
        assert p["backend"]["service"]["name"] == serve_service["metadata"]["name"]
        assert p["backend"]["service"]["port"]["name"] in ports


def test_pod_monitors_select_pods_and_ports_that_exist(overlay):
    _, resources = overlay
    by_name = groups(one(resources, "RayService"))
    for monitor in (r for r in resources if r["kind"] == "PodMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [(name, g) for name, g in by_name.items()
                   if wanted.items() <= {**g["template"]["metadata"]["labels"], "ray.io/group": name}.items()]
        assert matched, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for _, group in matched:
                assert endpoint["port"] in {p["name"] for p in group["template"]["spec"]["containers"][0]["ports"]}
    service_metrics = one(resources, "PodMonitor", "andromeda")
    assert service_metrics["spec"]["selector"]["matchLabels"]["ray.io/group"] == "cpu-workers"  # the routers' pods


# -- alerts, dashboard, capacity ------------------------------------------------------------------------------


def exported_metric_names() -> set[str]:
    """Every sample name the service's /metrics can show, from its registry (offline twin of the scrape test)."""
    metrics = ServiceMetrics()
    metrics.stage("retrieve", "total", 0.01)
    metrics.shard_latency.labels("0").observe(0.01)
    for counter in (metrics.requests.labels("retrieve"), metrics.errors.labels("internal"), metrics.eligible,
                    metrics.scanned, metrics.published):
        counter.inc()
    text = metrics.render([{name: 1 for name in metrics.shard}]).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="1"}[5m]))) > on() b and absent(c)') == \
        {"a_bucket", "b", "c"}
    with pytest.raises(Exception):
        promql_parser.parse("sum by (shard) (andromeda_shard_ready")


def test_alerts_cover_what_sres_page_on_and_name_only_exported_metrics(overlay):
    _, resources = overlay
    exprs = alert_exprs(resources)
    assert {"AndromedaStreamLag", "AndromedaErrorRate", "AndromedaLatencyP99", "AndromedaDeadLetters",
            "AndromedaShardNotReady", "AndromedaIndexMemoryHeadroom"} <= set(exprs)
    exported = exported_metric_names() | RAY_SERVE_METRICS | KUBELET_METRICS
    for alert, expr in exprs.items():
        names = metric_names(expr)
        assert names and names <= exported, f"{alert}: {names - exported}"


def test_shard_readiness_is_judged_per_ray_cluster_which_the_scrape_labels(overlay):
    """During an upgrade the new cluster's routers see shards still loading while the old cluster serves: the alert
    must group by the ray_cluster label, which only the PodMonitor's relabeling gives the service's series."""
    _, resources = overlay
    assert "ray_cluster" in alert_exprs(resources)["AndromedaShardNotReady"]
    [serve] = [e for r in resources if r["kind"] == "PodMonitor" for e in r["spec"]["podMetricsEndpoints"]
               if e["port"] == "serve"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "ray_cluster"} in \
        serve.get("relabelings", [])


def test_the_ray_serve_metrics_alerts_read_are_ray_serves():
    from ray.serve._private.common import RequestProtocol
    from ray.serve._private.request_ingress_metrics import RequestIngressMetrics
    proxy = RequestIngressMetrics(RequestProtocol.HTTP, source="proxy", node_id="n", node_ip_address="0.0.0.0")
    counter = proxy.request_counter  # every response of a proxy, its own 503s included
    assert {f"ray_{counter._name}_total"} == RAY_SERVE_METRICS
    assert {"application", "status_code"} <= set(counter._tag_keys)


def test_every_alert_has_a_runbook_section():
    operations = (ROOT / "docs" / "operations.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", operations, re.M)}
    for resource in build(K8S / "overlays" / "gpu-prod"):
        if resource["kind"] != "PrometheusRule":
            continue
        for group in resource["spec"]["groups"]:
            for rule in group["rules"]:
                assert rule["annotations"]["runbook_url"].split("#")[1] in anchors, rule["alert"]


def test_the_dashboard_is_grafana_json_over_exported_metrics(overlay):
    _, resources = overlay
    dashboard = json.loads(one(resources, "ConfigMap", "andromeda-grafana-dashboard")["data"]["andromeda.json"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "andromeda"
    exported = exported_metric_names()
    used = set()
    for expr in grafana_exprs(dashboard):
        names = metric_names(expr)
        assert names and names <= exported, f"{expr}: {names - exported}"
        used |= names
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in used}
    assert families - shown == set()  # every metric the service exports is on the dashboard


def test_headroom_thresholds_are_the_capacity_models(overlay):
    name, resources = overlay
    capacity = load_capacity_model()
    inputs = capacity.load_inputs()
    storage, rescore, memory, fraction, sharing = capacity.overlay_memory(inputs)[name]
    service = ServiceConfig.model_validate(serve_config(one(resources, "RayService"))["applications"][0]["args"])
    assert (service.storage, service.rescore > 0) == (storage, rescore > 0)
    if name == "cpu-dev":  # every shard replica in the one worker pod
        limit = groups(one(resources, "RayService"))["cpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert (quantity(limit["memory"]), service.shards * service.replicas) == (memory, sharing)
    expected = capacity.headroom_slots(capacity.ad_bytes(inputs, storage, rescore).held, memory, fraction, sharing)
    threshold = re.search(r"\(andromeda_shard_capacity\) > (\d+)", alert_exprs(resources)["AndromedaIndexMemoryHeadroom"])
    assert int(threshold.group(1)) == expected


def test_the_gpu_prod_latency_alert_is_at_the_router_budget_of_the_capacity_plan(overlay):
    name, resources = overlay
    expr = alert_exprs(resources)["AndromedaLatencyP99"]
    assert 'stage="total"' in expr and "endpoint=\"retrieve\"" in expr
    budget = float(re.search(r"> ([0-9.]+)\s*$", expr).group(1))
    planned = load_capacity_model().load_inputs()["workload"]["router_p99_budget_s"]
    assert budget == (planned if name == "gpu-prod" else 0.1)  # cpu-dev: CPU passes take tens of ms


def test_the_metrics_absent_alert_watches_its_own_namespace(overlay):
    """absent() keeps no labels: unscoped, one namespace's routers hid another's being gone."""
    _, resources = overlay
    namespace = one(resources, "PrometheusRule")["metadata"]["namespace"]
    assert alert_exprs(resources)["AndromedaMetricsAbsent"] == f'absent(andromeda_shard_ready{{namespace="{namespace}"}})'


def test_gpu_prod_pods_hold_a_restart_at_the_largest_table():
    """A GPU replica reads its whole snapshot into host memory: the gpu-workers' memory limit is the capacity
    model's, and covers loading a full table of the largest capacity the headroom alert lets a shard reach."""
    capacity = load_capacity_model()
    inputs = capacity.load_inputs()
    resources = build(K8S / "overlays" / "gpu-prod")
    limit = groups(one(resources, "RayService"))["gpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert quantity(limit["memory"]) == capacity.GPU_POD_MEMORY
    service = overlay_config(K8S / "overlays" / "gpu-prod")
    threshold = re.search(r"\(andromeda_shard_capacity\) > (\d+)", alert_exprs(resources)["AndromedaIndexMemoryHeadroom"])
    largest = capacity.largest_table(service.initial_capacity, int(threshold.group(1)))
    assert largest > int(threshold.group(1)) >= largest // 2
    assert capacity.gpu_host_bytes(inputs, service.storage, service.rescore, largest) <= capacity.GPU_POD_MEMORY


def test_gpu_prod_snapshot_volume_holds_every_shards_snapshots_at_the_largest_table():
    """Per shard: the 3 kept, the one being written before they are pruned, and the temp file a killed write leaves
    (removed after an hour), each of the largest table the headroom alert lets a shard reach; and an alert before it
    fills (until 2026-12-07 500Gi, full at about 50M ads a shard, and nothing said so)."""
    capacity = load_capacity_model()
    inputs = capacity.load_inputs()
    resources = build(K8S / "overlays" / "gpu-prod")
    service = overlay_config(K8S / "overlays" / "gpu-prod")
    threshold = re.search(r"\(andromeda_shard_capacity\) > (\d+)", alert_exprs(resources)["AndromedaIndexMemoryHeadroom"])
    largest = capacity.largest_table(service.initial_capacity, int(threshold.group(1)))
    needed = service.shards * (snapshots.KEEP + 2) * largest * capacity.snapshot_bytes(
        inputs, service.storage, service.rescore)
    claim = one(resources, "PersistentVolumeClaim", "andromeda-snapshots")["spec"]["resources"]["requests"]["storage"]
    assert needed <= quantity(claim) < 1.1 * needed
    assert 'persistentvolumeclaim="andromeda-snapshots"' in alert_exprs(resources)["AndromedaSnapshotVolumeFull"]


def test_gpu_prod_is_the_capacity_plan():
    capacity = load_capacity_model()
    inputs = capacity.load_inputs()
    plan = capacity.plan_deployment(inputs, *capacity.PROD, capacity.ad_bytes(inputs, "int8", 2))
    service = overlay_config(K8S / "overlays" / "gpu-prod")
    assert (service.shards, service.autoscaling.min_replicas) == (plan.shards, plan.replicas)
    assert service.autoscaling.max_replicas == 2 * plan.replicas
    assert service.initial_capacity == capacity.initial_capacity(inputs, plan)
    assert service.max_batch_size >= plan.plan.batch


def test_scaling_doc_is_what_the_capacity_model_writes():
    capacity = load_capacity_model()
    assert (ROOT / "docs" / "scaling.md").read_text() == capacity.report(capacity.load_inputs())


def test_capacity_model_pads_vector_rows_as_the_index_does():
    capacity = load_capacity_model()
    assert capacity.ROW_ALIGN == ROW_ALIGN
    for storage, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("int8", torch.int8)):
        rows = aligned_rows(2, 113, dtype)
        scales = capacity.vector_bytes("int8", 113) - 113 if storage == "int8" else 0
        assert capacity.vector_bytes(storage, 113, line=ROW_ALIGN) == rows.stride(0) * rows.element_size() + scales


def test_the_plan_at_measured_rates_times_passes_from_the_measured_h200_rates():
    capacity = load_capacity_model()
    inputs = capacity.load_inputs()
    b = capacity.ad_bytes(inputs, "int8", 2)
    measured = capacity.at_measured_rates(inputs)
    overhead = inputs["assumed"]["pass_overhead_s"]
    rates = {int(k): v for k, v in inputs["measured"]["gpu_pairs_per_s"].items()}
    for batch, rate in rates.items():  # every pair of the batch, as benchmarks.kernels counts them
        seconds, bound = capacity.pass_seconds(measured, 1e8, batch, b)
        assert bound == "measured" and 1e8 * batch / (seconds - overhead) == pytest.approx(rate)
    eight, _ = capacity.pass_seconds(measured, 1e8, 8, b)
    assert min(rates[4], rates[16]) < 8e8 / (eight - overhead) < max(rates[4], rates[16])
    assert capacity.measured_rate(rates, 256) == rates[64]


def test_only_the_services_pods_reach_redis(overlay):
    _, resources = overlay
    policy = one(resources, "NetworkPolicy", "andromeda-redis")["spec"]
    redis_pod = one(resources, "StatefulSet", "andromeda-redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_pod.items() and policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    allowed = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    for name, group in groups(one(resources, "RayService")).items():  # every Ray pod: head, routers, shards
        labels = group["template"]["metadata"]["labels"]
        assert any(a.items() <= labels.items() for a in allowed), name
    assert allowed[1] == {"andromeda.io/redis-client": "true"} and rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


OPERATOR_POD = {"app.kubernetes.io/component": "kuberay-operator"}  # the KubeRay operator's pods (Helm chart and
# kustomize install)
KUBERAY_DASHBOARD_PORT = 8265  # the operator's utils.DefaultDashboardPort: where rayStartParams sets no dashboard-port


def container_ports(group: dict) -> dict[str, int]:
    """A pod group's Ray container ports by name."""
    return {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}


def test_only_the_ray_pods_the_operator_and_the_cluster_on_the_serve_and_metrics_ports_reach_the_ray_pods(overlay):
    """Every Ray pod is selected; the Ray pods reach each other on every port; from any pod of the cluster only the
    ports the Ingress (through the serve Service) and the PodMonitors use; the operator the head's dashboard; no other
    rule. The ports come from the rendered manifests, so moving one without the policy fails here."""
    _, resources = overlay
    policy = one(resources, "NetworkPolicy", "andromeda-ray")["spec"]
    rayservice = one(resources, "RayService")
    by_name = groups(rayservice)
    assert policy["policyTypes"] == ["Ingress"] and "egress" not in policy
    selected = policy["podSelector"]["matchLabels"]
    for name, group in by_name.items():  # head, routers, shards
        assert selected.items() <= group["template"]["metadata"]["labels"].items(), name
    redis_pod = one(resources, "StatefulSet", "andromeda-redis")["spec"]["template"]["metadata"]["labels"]
    assert not selected.items() <= redis_pod.items()  # Redis has its own policy

    between, by_port = [], {}
    for rule in policy["ingress"]:
        if "ports" not in rule:
            between.append(rule)
            continue
        for port in rule["ports"]:
            assert set(port) == {"port", "protocol"} and port["protocol"] == "TCP" and port["port"] not in by_port
            by_port[port["port"]] = rule["from"]
    # among themselves every port, and only pods of this namespace (a peer with no namespaceSelector) that are Ray pods
    [rule] = between
    assert [set(peer) for peer in rule["from"]] == [{"podSelector"}]
    own = rule["from"][0]["podSelector"]["matchLabels"]
    assert all(own.items() <= g["template"]["metadata"]["labels"].items() for g in by_name.values())

    def number(port: int | str, group: str) -> int:
        return port if isinstance(port, int) else container_ports(by_name[group])[port]

    # the public API: Ingress -> serve Service (KubeRay's, from serveService: workers only) -> the pods' target port
    service_ports = {p["name"]: p for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    ingress = one(resources, "Ingress")
    backends = [path["backend"]["service"]["port"]["name"] for rule in ingress["spec"]["rules"]
                for path in rule["http"]["paths"]]
    served = {number(service_ports[name]["targetPort"], group) for name in backends for group in by_name
              if group != "head"}
    # what Prometheus scrapes: each PodMonitor endpoint's port on every pod group it selects
    scraped = set()
    for monitor in (r for r in resources if r["kind"] == "PodMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        for name, group in by_name.items():
            if wanted.items() <= {**group["template"]["metadata"]["labels"], "ray.io/group": name}.items():
                scraped |= {number(e["port"], name) for e in monitor["spec"]["podMetricsEndpoints"]}
    anyone = {port for port, peers in by_port.items() if peers == [{"namespaceSelector": {}}]}
    assert served and scraped and anyone == served | scraped
    # the head's serve port too: the operator checks its proxy there when excludeHeadPodFromServeSvc is false
    assert container_ports(by_name["head"])["serve"] in anyone

    # the operator: the head's dashboard, the port it takes from the head Service's port named dashboard
    head = by_name["head"]
    dashboard = container_ports(head)["dashboard"]
    assert int(head["rayStartParams"].get("dashboard-port", KUBERAY_DASHBOARD_PORT)) == dashboard
    operator = [port for port, peers in by_port.items() if port not in anyone]
    assert operator == [dashboard]
    [peer] = by_port[dashboard]  # the operator's pods in any namespace, or in one (Deploy, step 7)
    assert peer["podSelector"] == {"matchLabels": OPERATOR_POD} and set(peer) == {"namespaceSelector", "podSelector"}
    assert set(peer["namespaceSelector"].get("matchLabels", {})) <= {"kubernetes.io/metadata.name"}
    assert set(peer["namespaceSelector"]) <= {"matchLabels"}
    for name, group in by_name.items():  # the GCS and the Ray client stay among the Ray pods
        internal = {p for n, p in container_ports(group).items() if n in ("gcs-server", "client")}
        assert not internal & set(by_port), name
