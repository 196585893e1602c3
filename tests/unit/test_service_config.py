"""ServiceConfig: bounds, and the Serve config it writes validates with Ray's own schema."""
from __future__ import annotations

import os

import pytest
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.config import SERVE_ENV, Autoscaling, ServiceConfig, apply_serve_env, by_reference
from index_updater.clients import redis_client


def test_serve_config_validates_with_rays_schema_and_names_every_shard():
    config = ServiceConfig(redis_url="redis://127.0.0.1:6379/0", shards=3, replicas=2, device="cpu")
    schema = ServeDeploySchema.model_validate(config.to_serve_config())
    app = schema.applications[0]
    assert app.import_path == "deployments.app:app_builder"
    assert [d.name for d in app.deployments] == ["router", "shard-0", "shard-1", "shard-2"]
    assert all(d.num_replicas == 2 for d in app.deployments[1:])
    assert ServiceConfig.model_validate(app.args) == config  # the args rebuild the same config


def test_serve_config_leaves_the_redis_url_to_the_environment_unless_given():
    assert "redis_url" not in ServiceConfig().to_serve_config()["applications"][0]["args"]
    assert ServiceConfig(device="auto").shard_options()["ray_actor_options"]["num_gpus"] == 0


def test_autoscaling_and_cuda_options():
    config = ServiceConfig(redis_url="redis://r", device="cuda", autoscaling=Autoscaling(min_replicas=1, max_replicas=3))
    options = config.shard_options()
    assert options["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in options
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert ServiceConfig(redis_url="redis://r", device="cpu").shard_options()["ray_actor_options"]["num_gpus"] == 0


@pytest.mark.parametrize("bad, field", [({"shards": 0}, "shards"), ({"replicas": -1}, "replicas"),
                                        ({"storage": "int4"}, "storage"), ({"redis_url": ""}, "redis_url"),
                                        ({"redis_url": "redis://r/0?protocol=3"}, "redis_url"),
                                        ({"redis_url": "redis://r/0?decode_responses=true"}, "redis_url"),
                                        ({"shard_count": 2}, "shard_count"),
                                        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling"),
                                        ({"overload": {"router_queue": 0}}, "overload.router_queue"),
                                        ({"overload": {"shard_queue": 0}}, "overload.shard_queue"),
                                        ({"overload": {"write_inflight": 0}}, "overload.write_inflight"),
                                        ({"overload": {"write_timeout_s": 0}}, "overload.write_timeout_s"),
                                        ({"overload": {"write_timeout_s": "5"}}, "overload.write_timeout_s"),
                                        ({"overload": {"write_timeout_s": float("inf")}}, "overload.write_timeout_s"),
                                        ({"router_resources": {"a b": 1}}, "router_resources"),
                                        ({"router_resources": {"andromeda-router": 0}}, "router_resources")])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"redis_url": "redis://r", **bad})
    assert ".".join(map(str, info.value.errors()[0]["loc"])).startswith(field)


@pytest.mark.parametrize("seconds", [1e-6, 0.1, 0.49])
def test_the_write_timeout_has_a_floor(seconds):
    """A write's bound so short that every try times out on a healthy Redis is refused, naming the field and the floor
    (gt=0 took 1e-6: every write then failed)."""
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"redis_url": "redis://r", "overload": {"write_timeout_s": seconds}})
    error = info.value.errors()[0]
    assert error["loc"] == ("overload", "write_timeout_s") and "greater than or equal to 0.5" in error["msg"]
    assert ServiceConfig.model_validate({"overload": {"write_timeout_s": 0.5}}).overload.write_timeout_s == 0.5


@pytest.mark.parametrize("seconds", [0.01, 0.05, 0.999])
def test_the_stream_down_bound_has_a_floor(seconds):
    """An idle consumer's read blocks on Redis for 50 ms by design: a bound that short reported a healthy, idle
    replica's stream down (gt=0 took it)."""
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"redis_url": "redis://r", "stream_down_s": seconds})
    error = info.value.errors()[0]
    assert error["loc"] == ("stream_down_s",) and "greater than or equal to 1" in error["msg"]
    assert ServiceConfig.model_validate({"stream_down_s": 1.0}).stream_down_s == 1.0


def test_a_rejected_redis_url_is_not_echoed():
    with pytest.raises(ValidationError) as info:
        ServiceConfig(redis_url="redis://user:hunter2secret@host 6379")
    assert "hunter2secret" not in str(info.value) and info.value.errors()[0]["loc"][0] == "redis_url"
    assert "hunter2secret" not in repr(ServiceConfig(redis_url="redis://user:hunter2secret@host:6379/0"))


def test_bounded_queues_reach_the_serve_options():
    config = ServiceConfig.model_validate({"overload": {"router_inflight": 8, "router_queue": 16, "shard_queue": 4}})
    assert config.router_options()["max_queued_requests"] == 16 and config.shard_options()["max_queued_requests"] == 4
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"overload": {"request_timeout_s": 90, "max_request_timeout_s": 60}})
    assert info.value.errors()[0]["loc"][0] == "overload"


def without_serve_env(monkeypatch) -> None:
    """os.environ for this test only (restored after it), without the SERVE_ENV variables."""
    monkeypatch.setattr(os, "environ", {name: value for name, value in os.environ.items() if name not in SERVE_ENV})


def test_apply_serve_env_sets_ray_serves_settings_and_keeps_an_operators_own(monkeypatch):
    without_serve_env(monkeypatch)
    os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "0"
    apply_serve_env()
    assert os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"
    assert {name: os.environ[name] for name in SERVE_ENV if name != "RAY_SERVE_USE_GRPC_BY_DEFAULT"} == \
        {name: value for name, value in SERVE_ENV.items() if name != "RAY_SERVE_USE_GRPC_BY_DEFAULT"}


def test_handles_call_by_grpc_exactly_where_the_serve_env_says_so(monkeypatch):
    without_serve_env(monkeypatch)
    assert by_reference()
    apply_serve_env()
    assert not by_reference()
    os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "0"
    assert by_reference()


def test_the_load_benchmarks_ray_defaults_undo_every_serve_env_setting():
    from benchmarks.load import RAY_SERVE_DEFAULTS

    assert set(RAY_SERVE_DEFAULTS) == set(SERVE_ENV) and all(RAY_SERVE_DEFAULTS[k] != SERVE_ENV[k] for k in SERVE_ENV)


@pytest.mark.parametrize("url, words", [("redis://r/0?protocol=3", "protocol=3"),
                                        ("rediss://:pw@r:6380/1?decode_responses=yes", "decode_responses")])
def test_redis_url_options_that_change_the_replies_are_refused_wherever_the_url_comes_from(url, words, monkeypatch):
    """redis-py lets a URL's options override the client's: RESP3's dict replies or decoded strings would fail every
    read of a replica's consumer. Refused in the config, in REDIS_URL, and by the clients themselves."""
    with pytest.raises(ValidationError, match=words):
        ServiceConfig(redis_url=url)
    monkeypatch.setenv("REDIS_URL", url)
    with pytest.raises(RuntimeError, match=f"REDIS_URL: its query option {words}"):
        ServiceConfig().resolved_redis_url()
    with pytest.raises(ValueError, match=words):
        redis_client(url, 1.0)
    for fine in ("redis://r/0?protocol=2", "redis://r/0?decode_responses=false", "unix:///run/redis.sock?db=2"):
        assert ServiceConfig(redis_url=fine).redis_url == fine and redis_client(fine, 1.0) is not None


def test_credentials_lose_outer_whitespace_and_empty_paths_mean_the_default(monkeypatch):
    """A Kubernetes Secret made from a file ends in a line ending, and no HTTP header or URL carries outer whitespace:
    dropped (never refused: routers and shards read these at start). An empty ANDROMEDA_CACHE meant the working
    folder, whose models/ the quality run's stale-checkpoint cleanup deletes from."""
    from pathlib import Path

    from andromeda_core.config import load_settings

    monkeypatch.setenv("REDIS_URL", " redis://127.0.0.1:6379/0\n")
    monkeypatch.setenv("ANDROMEDA_WRITE_TOKEN", "s3cret \r\n")
    monkeypatch.setenv("ANDROMEDA_CACHE", "")
    settings = load_settings()
    assert settings.redis_url == "redis://127.0.0.1:6379/0" and settings.write_token == "s3cret"
    assert settings.cache_dir == Path(".cache")
    monkeypatch.setenv("ANDROMEDA_WRITE_TOKEN", " \n")
    assert load_settings().write_token is None  # blank: unset, writes refused


def test_a_rate_too_small_for_a_retry_after_is_refused():
    with pytest.raises(ValidationError, match="requests_per_s"):
        ServiceConfig.model_validate({"rate_limit": {"requests_per_s": 1e-320, "burst": 1}})


def test_routers_ask_for_their_custom_resources_only_where_configured():
    """None by default (one machine, `andromeda up`: no node offers any); gpu-prod keeps its routers on the cpu-workers
    through one."""
    assert "resources" not in ServiceConfig().router_options()["ray_actor_options"]
    options = ServiceConfig(router_resources={"andromeda-router": 1}).router_options()["ray_actor_options"]
    assert options == {"num_cpus": 0.5, "resources": {"andromeda-router": 1.0}}
