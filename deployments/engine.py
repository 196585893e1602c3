"""What both deployments build from a ServiceConfig: the schema and the scorer (one model per service)."""
from __future__ import annotations

from andromeda_core.config import load_settings
from andromeda_core.models import Scorer
from andromeda_core.models.serving import load_scorer
from andromeda_core.schema import Schema, load_schema
from deployments.config import ServiceConfig


def redis_url(config: ServiceConfig) -> str:
    """The config's Redis URL, or this process's REDIS_URL."""
    url = config.redis_url or load_settings().redis_url
    if not url:
        raise RuntimeError("no Redis: set redis_url in the service config or REDIS_URL in the replicas' environment")
    return url


def load_schema_of(config: ServiceConfig) -> Schema:
    return load_schema(config.schema_path)


def load_config_scorer(config: ServiceConfig, schema: Schema, device: str = "cpu") -> Scorer:
    """The configured checkpoint, or the untrained hashed two-tower when none is set."""
    return load_scorer(config.model, schema, device)
