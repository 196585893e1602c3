"""ServiceConfig: the one typed source of truth for a deployment of the service. It builds the Ray
Serve application (deployments.app.build_app), writes the Serve config YAML for `serve run` /
`serve deploy` (to_serve_config), and later the Kubernetes manifests."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

APP_NAME = "andromeda"
ROUTER = "router"


def shard_deployment(shard: int) -> str:
    return f"shard-{shard}"


STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Autoscaling(BaseModel):
    """Replicas per shard between bounds, scaled by Ray Serve on ongoing requests per replica."""

    model_config = STRICT
    min_replicas: int = Field(1, ge=1, le=256)
    max_replicas: int = Field(4, ge=1, le=256)
    target_ongoing_requests: float = Field(4.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class ServiceConfig(BaseModel):
    model_config = STRICT

    redis_url: str | None = Field(None, pattern=r"^(redis|rediss|unix)://\S+$")
    """Redis holding the per-shard update streams; None: each replica reads REDIS_URL from its environment
    (keep credentials there, out of config files)."""
    stream: str = Field("andromeda:ad-events", min_length=1, max_length=200)
    """Base name of the update streams: shard s reads `<stream>:<s>`; dead letters `<stream>:dead-letters`."""
    shards: int = Field(1, ge=1, le=1024)
    """Index shards; an ad belongs to shard hash(ad_id) % shards."""
    replicas: int = Field(1, ge=1, le=256)
    """Replicas per shard when `autoscaling` is not set."""
    autoscaling: Autoscaling | None = None
    """Autoscaling bounds per shard (overrides `replicas`)."""
    router_replicas: int = Field(1, ge=1, le=256)
    """Replicas of the router (the FastAPI ingress)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where a shard's ad table lives. cuda: each replica reserves one GPU. auto: cuda when the replica's
    process sees a GPU, else cpu, reserving none (set cuda for GPU clusters)."""
    model: str | None = Field(None, min_length=1)
    """Trained checkpoint (safetensors); None: the untrained hashed two-tower baseline."""
    storage: Literal["fp32", "fp16", "int8"] = "fp32"
    """Storage format of the ad vectors the scan reads."""
    schema_path: str | None = Field(None, min_length=1)
    """Targeting schema YAML; None: the shipped default."""
    snapshot_dir: str = Field("var/snapshots", min_length=1)
    """Directory of index snapshots (one sub-directory per shard), shared by the replicas of a shard."""
    snapshot_every_s: float = Field(60.0, gt=0)
    initial_capacity: int = Field(1024, ge=1, le=2**31)
    rescore: int = Field(2, ge=0, le=64)
    max_batch_size: int = Field(16, ge=1, le=1024)
    """Requests that may share one pass over a shard's table (@serve.batch)."""
    batch_wait_timeout_s: float = Field(0.002, ge=0, le=1)
    """How long a shard waits to fill a batch."""
    shard_timeout_s: float = Field(5.0, gt=0, le=60)
    """Deadline of one call from the router to a shard; one retry, then 503 naming the shard."""
    max_lag_s: float = Field(30.0, gt=0)
    """A replica whose unapplied stream entries are older than this fails its health check."""
    max_events_per_request: int = Field(10000, ge=1)
    shard_cpus: float = Field(0.5, gt=0)
    router_cpus: float = Field(0.5, gt=0)
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9.:\[\]-]+$")
    port: int = Field(8000, ge=1, le=65535)

    def resolved_redis_url(self) -> str:
        """`redis_url`, or REDIS_URL of the process that asks (a replica)."""
        from andromeda_core.config import load_settings

        url = self.redis_url or load_settings().redis_url
        if not url:
            raise RuntimeError("no Redis: set redis_url in the service config or REDIS_URL in the replicas' environment")
        return url

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def shard_options(self) -> dict:
        """Ray Serve deployment options of every shard deployment."""
        gpus = 1 if self.device == "cuda" else 0  # decided by the config, not by the machine that writes it
        scaling = ({"autoscaling_config": self.autoscaling.model_dump()} if self.autoscaling
                   else {"num_replicas": self.replicas})
        return {**scaling, "ray_actor_options": {"num_cpus": self.shard_cpus, "num_gpus": gpus},
                "max_ongoing_requests": 4 * self.max_batch_size,  # enough queued calls to fill a batch
                "health_check_period_s": 2, "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 5}

    def router_options(self) -> dict:
        return {"num_replicas": self.router_replicas, "ray_actor_options": {"num_cpus": self.router_cpus},
                "max_ongoing_requests": 256,  # the router mostly awaits shards; Serve's default of 5 queues requests
                "graceful_shutdown_timeout_s": 5}

    def to_serve_config(self) -> dict:
        """The Serve config file (`serve deploy` / `serve run` / KubeRay serveConfigV2) for this config."""
        deployments = [{"name": ROUTER, **self.router_options()}]
        deployments += [{"name": shard_deployment(s), **self.shard_options()} for s in range(self.shards)]
        return {
            "proxy_location": "EveryNode",
            "http_options": {"host": self.host, "port": self.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "deployments.app:app_builder",
                              "args": self.model_dump(mode="json", exclude_none=True), "deployments": deployments}],
        }
