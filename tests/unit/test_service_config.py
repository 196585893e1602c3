"""ServiceConfig: bounds, and the Serve config it writes validates with Ray's own schema."""
from __future__ import annotations

import pytest
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.api import Unauthorized, check_write_token
from deployments.config import Autoscaling, ServiceConfig


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
                                        ({"shard_count": 2}, "shard_count"),
                                        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling")])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"redis_url": "redis://r", **bad})
    assert info.value.errors()[0]["loc"][0] == field


def bearer(token: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


def test_write_token_check():
    check_write_token("s3cret", bearer("s3cret"))
    for expected, given in (("s3cret", None), ("s3cret", bearer("s3cre")), ("s3cret", bearer("s3cret2")),
                            (None, bearer("anything")), ("", bearer(""))):
        with pytest.raises(Unauthorized):
            check_write_token(expected, given)
