"""ServiceConfig: the one typed source of truth for a deployment of the service. It builds the Ray
Serve application (deployments.app.build_app), writes the Serve config YAML for `serve run` /
`serve deploy` (to_serve_config), and later the Kubernetes manifests."""
from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from andromeda_core.config import STREAM_MAX_CHARS
from andromeda_core.types import CO_ENGAGEMENT_MAX, COHORTS_MAX, HISTORY_MAX, K_MAX
from index_updater.clients import unsupported_options

BATCH_MAX = 4096  # the most requests of one POST /v1/retrieve:batch, whatever limits.batch_requests says

APP_NAME = "andromeda"
ROUTER = "router"
REFUSING_SLOTS = 256  # requests a router replica takes past overload.router_inflight only to answer 503 itself (the
# JSON error with Retry-After, before reading a body): past them Ray Serve queues (overload.router_queue) and then
# refuses in its proxy, plain text


# Ray Serve settings of every process of the service's Ray cluster: gRPC instead of Ray object references from the
# proxy to the router and from the router to the shards, and each replica's handle routing on its main event loop
# (two settings of Ray 2.60's RAY_SERVE_THROUGHPUT_OPTIMIZED preset; the rest of it measured within noise of these
# two), with gRPC messages up to 1 GiB instead of 4 MiB (a shard's answer to a retrieve:batch at the largest limits is
# about 30 MB). Against Ray's defaults on the 2-core dev box (docs/benchmarks.md, "Ray Serve settings"): p50 at
# 10 requests/s lower in each of 5 interleaved pairs of runs, and more of 70 requests/s answered in 4 of 5. Ray reads
# them when each of its processes starts: locally they are set before ray.init (apply_serve_env), on Kubernetes the
# image sets them (k8s/image/Dockerfile; tests/k8s keeps the two equal).
SERVE_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**30),
}


def apply_serve_env() -> None:
    """SERVE_ENV into this process's environment where a variable is not set already (an operator's value wins);
    call before ray.init, whose processes inherit it."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def by_reference() -> bool:
    """Whether handles made in this process call by Ray object reference (False: gRPC), as RAY_SERVE_USE_GRPC_BY_DEFAULT
    says. A handle carries the default of the process that built it, fixed when that process imported ray.serve: the
    shard handles the router gets are built by the process that deploys the app (locally, a driver that may have
    imported ray.serve before apply_serve_env), so the router sets its own (Router.__init__)."""
    return os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT", "0") != "1"


def shard_deployment(shard: int) -> str:
    return f"shard-{shard}"


# hide_input_in_errors: a rejected redis_url must not be echoed (it may hold a password)
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, hide_input_in_errors=True)


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


ResourceName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # a Ray custom resource's name


class Limits(BaseModel):
    """Bounds on every input the ingress takes; a request past one gets a 4xx naming the field and the limit
    (413 for the body, 422 for the rest). The wire types' own bounds are the ceilings."""

    model_config = STRICT
    body_bytes: int = Field(8 << 20, ge=1024, le=1 << 30)
    """Largest request body (413 beyond it, before it is parsed)."""
    k: int = Field(K_MAX, ge=1, le=K_MAX)
    """Largest `k` of a retrieval request."""
    batch_requests: int = Field(256, ge=1, le=BATCH_MAX)
    """Requests in one `POST /v1/retrieve:batch`."""
    history: int = Field(HISTORY_MAX, ge=0, le=HISTORY_MAX)
    """Events in `user.history`."""
    co_engagement: int = Field(CO_ENGAGEMENT_MAX, ge=0, le=CO_ENGAGEMENT_MAX)
    """Entries in `user.co_engagement`."""
    cohorts: int = Field(COHORTS_MAX, ge=0, le=COHORTS_MAX)
    """Entries in `user.cohorts`."""
    values_per_category: int = Field(64, ge=1, le=1 << 20)
    """Values a user may hold in one targeting category (`user.attributes.<category>`)."""
    string_chars: int = Field(256, ge=1, le=1 << 16)
    """Longest string value in `user.attributes`, `context` and `user.co_engagement[].surface` (ad creatives have
    the wire type's bounds)."""


class RateLimit(BaseModel):
    """A token bucket per caller (the bearer token's name; without a token, the client address), per router
    replica or, with `shared`, one for the whole service: `burst` requests at once, refilled at
    `requests_per_s`. Past it: 429 with Retry-After."""

    model_config = STRICT
    requests_per_s: float = Field(ge=1e-3, le=1e6)  # at least one request in 1,000 s: a Retry-After stays short
    burst: int = Field(ge=1, le=1 << 20)
    callers: int = Field(100_000, ge=1, le=10_000_000)
    """Buckets kept per router replica (least recently used dropped first: memory stays bounded)."""
    shared: bool = False
    """Keep the buckets in the service's Redis (keys `<stream>:rate:<caller>`, expiring when idle), shared by
    every router replica; False: each router replica has its own (N replicas admit N times the rate)."""
    store_timeout_s: float = Field(0.05, gt=0, le=5)
    """With `shared`: how long a router waits for Redis; past it (or Redis down) the router decides with its
    own bucket for a second (fail open to per-replica limits; deployments/shared_limits.py)."""


class Auth(BaseModel):
    """Who may write (and, with `read_auth`, read). ANDROMEDA_WRITE_TOKEN (environment) is always an admin
    token; `token_file` adds named tokens, stored as salted hashes only (deployments/auth.py)."""

    model_config = STRICT
    token_file: str | None = Field(None, min_length=1)
    """JSON file of hashed tokens (`andromeda token` writes it), re-read without a restart when it
    changes; None: only ANDROMEDA_WRITE_TOKEN."""
    reload_s: float = Field(2.0, gt=0, le=3600)
    """How often a router checks `token_file` for changes."""
    read_auth: bool = False
    """Retrieval and GET /v1/ads also need a valid token (any role)."""


class Overload(BaseModel):
    """Bounded queues and deadlines: past the bounds the service answers 503 with Retry-After at once
    instead of queueing; a request's deadline is honoured by the router and the shards."""

    model_config = STRICT
    router_inflight: int = Field(32, ge=1, le=65536)
    """Requests one router replica works on at once; more get 503 at once."""
    router_queue: int = Field(32, ge=-1, le=65536)
    """Requests Ray Serve may queue in front of the routers (max_queued_requests; -1: unbounded)."""
    shard_queue: int = Field(128, ge=-1, le=65536)
    """Calls one router replica may queue for a shard's replicas (max_queued_requests; -1: unbounded);
    beyond it the request gets 503."""
    request_timeout_s: float = Field(10.0, gt=0, le=600)
    """Deadline of a request that does not send `X-Request-Timeout-Ms`."""
    max_request_timeout_s: float = Field(60.0, gt=0, le=600)
    """Longest deadline a request may ask for."""
    retry_after_s: int = Field(1, ge=1, le=3600)
    """Retry-After of a 503."""
    latency_target_ms: int = Field(500, ge=0, le=600_000)
    """When every retrieval a router completed over `latency_interval_ms` took longer than this, a queue stands:
    the router answers new retrievals 503 until one completes within it (0: off; deployments.limits.LatencyShedder).
    Keep it above the slowest request's time without a queue (a large batch)."""
    latency_interval_ms: int = Field(1000, ge=1, le=600_000)
    """How long requests must stay over `latency_target_ms` before the router sheds."""
    write_inflight: int = Field(4, ge=1, le=1024)
    """Writes (`POST /v1/ad-events`) one router replica works on at once, each on a thread of the write path's own
    (their Redis calls and ad towers: retrievals never wait for them); one more waits up to 0.1 s for one to end
    (router.WRITE_SLOT_WAIT_S), then gets 503 `overloaded`."""
    write_timeout_s: float = Field(5.0, ge=0.5, le=600)
    """Bound on each Redis step of a write (an advertiser's check, then the append; about twice it in all for an
    advertiser's write): a try waits about 0.45 of it for a connection or a reply (index_updater.publisher.try_wait),
    so that one that timed out is followed by one more; past it the write gets 503 `unavailable` (after the append:
    some or all of its batch may have been appended all the same). At least 0.5 s: below, a try's wait nears what a
    large batch's append takes on a healthy Redis, and every write could fail."""

    @field_validator("router_queue", "shard_queue")
    @classmethod
    def _a_queue_holds_one(cls, value: int) -> int:
        if value == 0:  # Ray Serve refuses the deployed config, naming its own option
            raise ValueError("must be -1 (unbounded) or at least 1: Ray Serve's max_queued_requests takes no 0")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> "Overload":
        if self.request_timeout_s > self.max_request_timeout_s:
            raise ValueError("request_timeout_s must not exceed max_request_timeout_s")
        return self


class Trim(BaseModel):
    """Stream trimming by the shard replicas (XTRIM MINID). A shard's stream is trimmed only below what
    every live replica of the shard has applied AND what the oldest kept snapshot of the shard covers, so
    no entry an index still needs is removed; `keep_entries` newest entries always stay."""

    model_config = STRICT
    every_s: float = Field(60.0, gt=0)
    """How often a replica considers trimming (after a snapshot at the latest)."""
    keep_entries: int = Field(10000, ge=0, le=1 << 40)  # an XREVRANGE COUNT Redis takes
    """Newest entries of each shard stream that are never trimmed (MAXLEN as a floor, not a ceiling)."""
    replica_ttl_s: float = Field(60.0, gt=0)
    """A replica that has not reported its applied id for this long no longer holds trimming back (a
    restarted one loads a snapshot)."""


class ServiceConfig(BaseModel):
    model_config = STRICT

    redis_url: str | None = Field(None, pattern=r"^(redis|rediss|unix)://\S+$", repr=False)
    """Redis holding the per-shard update streams; None: each replica reads REDIS_URL from its environment
    (keep credentials there, out of config files)."""
    stream: str = Field("andromeda:ad-events", max_length=STREAM_MAX_CHARS, pattern=r"\S")  # not blank
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
    """Directory of index snapshots (one sub-directory per shard), shared by the replicas of a shard: one of them
    writes each round's snapshot for all (a replica with a directory of its own would mostly have none)."""
    snapshot_every_s: float = Field(60.0, gt=0)
    """A shard's snapshot round: in each, the first of its replicas to claim it writes one."""
    initial_capacity: int = Field(1024, ge=1, le=2**31)
    """Slots each shard's table allocates up front (it doubles when full; ANDROMEDA_INITIAL_CAPACITY)."""
    rescore: int = Field(2, ge=0, le=64)
    """The fused pass shortlists rescore x k slots per request and the scorer rescores them exactly (0: a shortlist of
    k, no float32 copy of an fp16/int8 table; ANDROMEDA_RESCORE)."""
    max_batch_size: int = Field(16, ge=1, le=1024)
    """Requests that may share one pass over a shard's table (@serve.batch)."""
    batch_wait_timeout_s: float = Field(0.002, ge=0, le=1)
    """How long a shard waits to fill a batch."""
    shard_timeout_s: float = Field(5.0, gt=0, le=60)
    """Deadline of one call from the router to a shard; one retry, then 503 naming the shard."""
    max_lag_s: float = Field(30.0, gt=0)
    """A replica whose unapplied stream entries are older than this fails its health check."""
    stream_down_s: float = Field(10.0, ge=1.0)
    """A replica whose consumer has read nothing of its stream for this long, each read failing or waiting on Redis
    (down, hung, unreachable, refusing its credentials), reports its update path down: `stream_up` false and the
    reason in /readyz, andromeda_shard_stream_up 0. It stays ready and healthy (it serves what it applied, and a
    replacement could not start without Redis), its lag too. At least 1 s: an idle consumer's read blocks on Redis
    for its block time (50 ms) by design, which a bound that short would report as down."""
    max_events_per_request: int = Field(10000, ge=1)
    """Events in one `POST /v1/ad-events` (422 beyond it)."""
    limits: Limits = Limits()
    rate_limit: RateLimit | None = None
    """Per-caller request rate; None: unlimited."""
    auth: Auth = Auth()
    overload: Overload = Overload()
    trim: Trim | None = None
    """Stream trimming; None: streams are never trimmed by the service. Turn it on only where every
    replica of a shard shares the snapshot directory (a new replica must find a snapshot covering what
    was trimmed)."""
    shard_cpus: float = Field(0.5, gt=0)
    """Ray CPUs each shard replica asks for."""
    router_cpus: float = Field(0.5, gt=0)
    """Ray CPUs each router replica asks for."""
    router_resources: dict[ResourceName, Annotated[float, Field(gt=0, le=1e6)]] = Field(default_factory=dict)
    """Ray custom resources every router replica asks for besides its CPUs: a worker group that alone offers them keeps
    the routers there (gpu-prod: its cpu-workers; a GPU pod with no shard replica yet also had the CPUs of a router,
    which then served writes without the write token its pods lack). {} (the default): any node."""
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9.:\[\]-]+$")
    """Address Ray Serve's HTTP proxies listen on (0.0.0.0 on a cluster)."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of Ray Serve's HTTP proxies."""

    @field_validator("redis_url")
    @classmethod
    def _redis_replies(cls, url: str | None) -> str | None:
        if url and (why := unsupported_options(url)):
            raise ValueError(why)
        return url

    def resolved_redis_url(self) -> str:
        """`redis_url`, or REDIS_URL of the process that asks (a replica)."""
        from andromeda_core.config import load_settings

        url = self.redis_url or load_settings().redis_url
        if not url:
            raise RuntimeError("no Redis: set redis_url in the service config or REDIS_URL in the replicas' environment")
        if why := unsupported_options(url):
            raise RuntimeError(f"REDIS_URL: {why}")
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
                "max_queued_requests": self.overload.shard_queue,
                "health_check_period_s": 2, "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 5}

    def router_options(self) -> dict:
        resources = {"resources": dict(self.router_resources)} if self.router_resources else {}
        return {"num_replicas": self.router_replicas, "ray_actor_options": {"num_cpus": self.router_cpus, **resources},
                "max_ongoing_requests": self.overload.router_inflight + REFUSING_SLOTS,
                "max_queued_requests": self.overload.router_queue,
                "backpressure_config": {"retry_after_s": self.overload.retry_after_s},  # on the proxy's refusals too
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
