"""Build the Ray Serve application from a ServiceConfig: one shard deployment per index shard (each
with its replicas) and the router, which is the FastAPI ingress."""
from __future__ import annotations

from ray.serve import Application

from deployments.config import ROUTER, ServiceConfig, shard_deployment
from deployments.router import Router
from deployments.shard import ShardReplica


def build_app(config: ServiceConfig) -> Application:
    args = config.model_dump(mode="json")
    shards = [ShardReplica.options(name=shard_deployment(s), **config.shard_options()).bind(args, s)
              for s in range(config.shards)]
    return Router.options(name=ROUTER, **config.router_options()).bind(args, *shards)


def app_builder(args: dict) -> Application:
    """Entry point of the Serve config file's import_path (`deployments.app:app_builder`)."""
    return build_app(ServiceConfig.model_validate(args))
