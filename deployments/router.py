"""Router: the FastAPI ingress deployment. Per request it compiles the targeting values, runs the user
towers once (history ad vectors are fetched from the shards that own those ads), sends the compact
UserQuery to one replica of every shard concurrently, and merges their partial top-k exactly
(score desc, ad id asc). A shard that misses its deadline is asked once more (Serve routes the retry
again, away from a dead replica); if it fails again the request gets 503 naming the shard, or, when
the request allows it, a partial answer that lists the missing shard."""

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Sequence

import grpc
import redis
import torch
from fastapi import Depends, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BeforeValidator, Field
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from andromeda_core.config import install_log_redaction, load_settings
from andromeda_core.errors import (AndromedaError, DeadlineExceeded, Forbidden, InvalidInput, NotFound, Overloaded,
                                   RateLimited, Unauthorized)
from andromeda_core.ingest import prepare_ops
from andromeda_core.models import EmbeddingLookup
from andromeda_core.models.serving import ModelScorer, load_scorer
from andromeda_core.retriever import CompiledRequest, UserQuery, compile_requests, merge_topks
from andromeda_core.schema import load_schema
from andromeda_core.sharding import shard_of
from andromeda_core.types import INT64, AdEvent, RetrieveRequest, RetrieveResponse, UpsertEvent
from deployments.api import (BODY_ERRORS, ERRORS, WRITE_ERRORS, AdState, BatchResponse, GuardSettings, Health,
                             PublishResponse, bearer_token, create_app, current_deadline, lift_deadline,
                             remaining_s)
from deployments.auth import ENV_ADMIN, Principal, TokenStore
from deployments.config import BATCH_MAX, ServiceConfig, by_reference
from deployments.limits import ThreadLane, TokenBuckets, check_requests, over_limit
from deployments.metrics import ServiceMetrics
from deployments.shared_limits import SharedTokenBuckets
from deployments.shard import EXPIRED, Mismatch, ShardAnswer, ShardQuery, serving_identity
from index_updater.owners import ADMIN, Writer
from index_updater.clients import redis_client
from index_updater.publisher import Publisher

metrics = ServiceMetrics()  # one per process: a router replica is one Ray actor process
app = create_app(on_error=lambda cause: metrics.errors.labels(cause).inc())
log = logging.getLogger(__name__)
HISTORY_SHARE = 0.3  # of the time a request has left, what the history lookup's shard calls may take: the searches
# need the rest (a dead shard owning a history ad made the lookup's tries take 90% of it, and no answer came in time)
ANSWER_SHARE = 0.9  # of the time a request has left, what its shard calls may take: the rest answers
WRITE_SLOT_WAIT_S = 0.1  # how long a write that finds every write slot taken waits for one before its 503: a write on
# a healthy Redis frees its slot in milliseconds (more, where ad towers embed a large batch), so a burst past
# write_inflight waits briefly instead of being refused; on a hung Redis the slots stay taken and the 503 comes this
# much later. The waiting writes hold no thread.
bearer = HTTPBearer(auto_error=False)


def caller_of(request: Request, principal: Principal | None) -> str:
    """The rate limiter's key: the token's name (ANDROMEDA_WRITE_TOKEN's a key of its own: a token file's token may
    be named "admin" too, and shared its bucket), else the client's address."""
    if principal is ENV_ADMIN:
        return "env:ANDROMEDA_WRITE_TOKEN"
    if principal is not None:
        return f"token:{principal.name}"
    return f"addr:{request.client.host if request.client else '-'}"


def take_rate(request: Request, principal: Principal | None) -> None:
    buckets: TokenBuckets | SharedTokenBuckets | None = getattr(request.app.state, "buckets", None)
    if buckets is None:
        return
    wait = buckets.take(caller_of(request, principal))
    if wait > 0:
        raise RateLimited(f"more than {buckets.rate:g} requests/s (rate_limit.requests_per_s, burst "
                          f"{buckets.burst}) from this caller", "Authorization" if principal else "request", wait)


def writer(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """Dependency of the write endpoints: the caller's principal (401 without a valid token, 403 for a
    reader token, 429 past its rate). Runs before the body is validated (for a body that is not JSON, through
    authorize), so a caller without a token learns nothing from the validation."""
    tokens: TokenStore = request.app.state.tokens
    if not tokens.writes_enabled:
        raise Unauthorized("writes are disabled: the service has neither ANDROMEDA_WRITE_TOKEN nor auth.token_file",
                           "Authorization")
    principal = authenticated(request, credentials)
    if not principal.can_write:
        raise Forbidden(f"token {principal.name} may only read", "Authorization")
    return principal


def reader(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal | None:
    """Dependency of the read endpoints: with auth.read_auth a valid token of any role is needed (401), and so is
    one sent (any Authorization header: another scheme, or none, was served as no token until 2026-12-07); every
    caller is held to its rate (429)."""
    if "authorization" in request.headers or request.app.state.read_auth:
        return authenticated(request, credentials)
    take_rate(request, None)
    return None


def authenticated(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The principal of the request's bearer token, the call counted against its rate (429); 401 without a valid
    one, the call counted against the caller's address: refused calls are held to a rate too (until 2026-12-06 they
    were not, and could flood the service)."""
    try:
        principal = request.app.state.tokens.verify(bearer_token(credentials))
    except Unauthorized:  # no bearer token
        take_rate(request, None)
        raise
    take_rate(request, principal)
    if principal is None:
        raise Unauthorized("invalid token", "Authorization")
    return principal


async def authorize(request: Request) -> None:
    """Runs the auth dependencies (writer, reader) of the request's route: for a body that is not JSON, which
    FastAPI refuses before any dependency runs (create_app's handlers call this first)."""
    route = request.scope.get("route")
    for dependency in getattr(getattr(route, "dependant", None), "dependencies", ()):
        if dependency.call in (writer, reader):  # sync, as FastAPI runs them: off the event loop (token file, Redis)
            await run_in_threadpool(dependency.call, request, await bearer(request))


app.state.authorize = authorize


def rate_limiter(cfg: ServiceConfig) -> TokenBuckets | SharedTokenBuckets | None:
    """The router's buckets: none, its own, or the ones every router shares in Redis (`rate_limit.shared`)."""
    limit = cfg.rate_limit
    if limit is None:
        return None
    local = TokenBuckets(limit.requests_per_s, limit.burst, limit.callers)
    if not limit.shared:
        return local
    # one try of store_timeout_s: a slow store must not slow every request
    return SharedTokenBuckets(redis_client(cfg.resolved_redis_url(), limit.store_timeout_s), f"{cfg.stream}:rate:",
                              local, on_fallback=metrics.limiter_fallbacks.inc)


def decimal_id(text: object) -> object:
    """An ad id in a path as written in decimal, nothing else: `1.0`, `+1` or `01` would name ad 1 too."""
    if isinstance(text, str) and not re.fullmatch(r"0|[1-9][0-9]*", text):
        raise ValueError("must be written as a decimal integer, without a sign, leading zeros or a fraction")
    return text


AD_ID = Annotated[INT64, BeforeValidator(decimal_id), Path()]  # INT64's bounds: Path's own are floats, which
# misprinted 2**63 in the error and gave the schema no JSON Schema keywords


class ShardUnavailable(AndromedaError):
    """A shard did not answer within its deadline, twice."""


class ShardMismatch(ShardUnavailable):
    """A shard serves another model or schema than the router (a rollout half done, or a misconfiguration): its
    answer would be read under the wrong one."""


@dataclass(frozen=True)
class Missing:
    """A shard's place among the answers when allow_partial left it out, and why: ShardUnavailable or Overloaded."""

    error: AndromedaError


async def as_answer(missing: Missing) -> Missing:
    """A shard's place among the search's answers without asking it (it did not answer the history lookup)."""
    return missing


class StreamUnavailable(AndromedaError):
    """Redis did not answer a write's step within about overload.write_timeout_s (its message says whether some of the
    batch may have been appended)."""


def oldest(watermarks: Sequence[str | None]) -> str | None:
    """The stream id up to which every shard has applied its updates (None if any shard has none)."""
    if any(w is None for w in watermarks) or not watermarks:
        return None
    return min(watermarks, key=lambda w: tuple(int(p) for p in w.split("-")))


def json_response(status: int, body: Health) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, config: dict, *shards):
        install_log_redaction()
        self.config = cfg = ServiceConfig.model_validate(config)
        self.shards = [shard.options(_by_reference=by_reference()) for shard in shards]  # SERVE_ENV's gRPC
        # one router per process: the app's guard and dependencies read these
        app.state.guard = GuardSettings(cfg.limits.body_bytes, cfg.overload.router_inflight, cfg.overload.request_timeout_s,
                                        cfg.overload.max_request_timeout_s, cfg.overload.retry_after_s,
                                        cfg.overload.latency_target_ms / 1000, cfg.overload.latency_interval_ms / 1000)
        app.state.retry_after_s = cfg.overload.retry_after_s
        app.state.limits = cfg.limits
        app.state.tokens = TokenStore(load_settings().write_token, cfg.auth.token_file, cfg.auth.reload_s)
        app.state.read_auth = cfg.auth.read_auth
        app.state.buckets = rate_limiter(cfg)
        self.schema = load_schema(self.config.schema_path)
        self.scorer = load_scorer(self.config.model, self.schema)
        self.identity = serving_identity(self.scorer.name, self.schema)  # what every shard must serve too
        if isinstance(self.scorer, ModelScorer):  # it embeds the ads of every write: load its sentence model now
            self.scorer.warm_up()
        # A write's Redis calls and ad towers run on threads of their own, each Redis step bounded: with them in the
        # default pool, a few writes waiting on a hung Redis (5 tries of 5 s) stalled every retrieval's user towers
        self.writes = ThreadLane(cfg.overload.write_inflight, "writes", "overload.write_inflight",
                                 cfg.overload.retry_after_s, wait_s=WRITE_SLOT_WAIT_S)
        self.publisher = Publisher.bounded(cfg.resolved_redis_url(), self.schema, self.scorer,
                                           cfg.overload.write_timeout_s, shards=cfg.shards, stream=cfg.stream,
                                           attempts=5)
        self.metrics = metrics
        self.last_status: dict[int, dict] = {}  # each shard's last answer to `status` (shard_status)

    # -- retrieval -------------------------------------------------------------------------------

    @app.post("/v1/retrieve", response_model=RetrieveResponse, responses=BODY_ERRORS)
    async def retrieve(self, request: RetrieveRequest, _: Principal | None = Depends(reader)) -> RetrieveResponse:
        """Top-k eligible ads for one request."""
        return (await self.answer([request], "retrieve", ""))[0]

    @app.post("/v1/retrieve:batch", response_model=BatchResponse, responses=BODY_ERRORS)
    async def retrieve_batch(self, requests: Annotated[list[RetrieveRequest], Field(min_length=1, max_length=BATCH_MAX)],
                             _: Principal | None = Depends(reader)) -> BatchResponse:
        """Several requests in one call; they share the passes over each shard, one per `max_batch_size` of them."""
        if len(requests) > self.config.limits.batch_requests:
            raise InvalidInput(over_limit(self.config.limits, "batch_requests", " requests", len(requests)), "body")
        return BatchResponse(responses=await self.answer(requests, "retrieve_batch", "[{}]."))

    async def answer(self, requests: Sequence[RetrieveRequest], endpoint: str, where: str) -> list[RetrieveResponse]:
        started = time.perf_counter()
        check_requests(self.config.limits, requests, where)
        compiled = self.compiled(requests, where)
        allow_partial = all(r.allow_partial for r in requests)
        t0 = time.perf_counter()
        lookup, unreachable = await self.history_lookup(requests, allow_partial)
        t1 = time.perf_counter()
        nows = [c.now for c in compiled]
        remaining_s()
        users = await asyncio.to_thread(self.scorer.encode_users, requests, lookup, nows)
        t2 = time.perf_counter()
        remaining_s()
        query = ShardQuery(UserQuery(users, [c.values for c in compiled], nows, [r.k for r in requests]), current_deadline(),
                           self.identity)
        method = "search" if len(requests) <= self.config.max_batch_size else "search_alone"  # @serve.batch's bound
        answers = await asyncio.gather(*(self.ask(s, allow_partial, method, query) if s not in unreachable
                                         else as_answer(unreachable[s]) for s in range(len(self.shards))))
        t3 = time.perf_counter()
        if any(isinstance(a, str) and a == EXPIRED for a in answers):  # a shard dropped the query: its deadline had passed
            remaining_s()
            raise DeadlineExceeded("the request's deadline passed in a shard's queue", "X-Request-Timeout-Ms")
        responses = self.merge(requests, compiled, answers, unreachable, started)
        done = time.perf_counter()
        for stage, seconds in (("compile", t0 - started), ("history", t1 - t0), ("user_towers", t2 - t1),
                               ("shards", t3 - t2), ("merge", done - t3)):
            self.metrics.stage(endpoint, stage, seconds)
        self.answered(endpoint, started)
        return responses

    def compiled(self, requests: Sequence[RetrieveRequest], where: str) -> list[CompiledRequest]:
        """Targeting values of each request; the first bad one fails the call naming its field."""
        compiled = compile_requests(self.schema, requests)
        for i, c in enumerate(compiled):
            if isinstance(c, AndromedaError):
                raise InvalidInput(c.message, f"{where.format(i)}{c.field}")
        return compiled

    async def history_lookup(self, requests: Sequence[RetrieveRequest],
                             allow_partial: bool) -> tuple[EmbeddingLookup, dict[int, Missing]]:
        """Fetch the stored vectors of every history and co-engagement ad of the batch from the shards
        that own them (one concurrent call per shard, their tries within HISTORY_SHARE of the time left) ->
        (lookup(ad ids) for the user towers, the shards that did not answer: their ads count as not indexed, and
        they are not searched; only with allow_partial)."""
        wanted = sorted({h.ad_id for r in requests for h in r.user.history} |
                        {c.ad_id for r in requests for c in r.user.co_engagement})
        by_shard: dict[int, list[int]] = {}
        for ad_id in wanted:
            by_shard.setdefault(shard_of(ad_id, len(self.shards)), []).append(ad_id)
        replies = await asyncio.gather(*(self.ask(s, allow_partial, "vectors", ids, self.identity, share=HISTORY_SHARE)
                                         for s, ids in by_shard.items()))
        found: dict[int, torch.Tensor] = {}
        for ids, reply in zip(by_shard.values(), replies):
            if not isinstance(reply, Missing):
                found.update((i, v) for i, v, hit in zip(ids, reply.vectors, reply.found.tolist()) if hit)
        zero = torch.zeros(self.scorer.dim)

        def lookup(ad_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
            if not ad_ids:
                return torch.zeros((0, self.scorer.dim)), torch.zeros(0, dtype=torch.bool)
            return (torch.stack([found.get(i, zero) for i in ad_ids]),
                    torch.tensor([i in found for i in ad_ids], dtype=torch.bool))

        return lookup, {s: reply for s, reply in zip(by_shard, replies) if isinstance(reply, Missing)}

    async def ask(self, shard: int, allow_partial: bool, method: str, *args: Any, share: float = 0.0) -> Any:
        """`call` (share: its tries' share of the time left, default ANSWER_SHARE), except that with allow_partial a
        shard that does not answer (ShardUnavailable) or whose queue is full (Overloaded) gives Missing(that error).
        A shard's own error (its answer, or a bug) still fails the request."""
        try:
            return await self.call(shard, method, *args, share=share or ANSWER_SHARE)
        except (ShardUnavailable, Overloaded) as exc:
            if allow_partial:
                return Missing(exc)
            raise

    async def call(self, shard: int, method: str, *args: Any, attempts: int = 2, timeout_s: float | None = None,
                   share: float = ANSWER_SHARE) -> Any:
        """Call a shard with a deadline (shard_timeout_s, times the request's deadline over the default one where
        that is longer); a call that times out or whose replica died is made again
        (attempts in all), then ShardUnavailable names the shard. The tries share `share` of what the request's
        deadline leaves as the call begins (by default all but a tenth kept for the answer), so that the last one gives
        up in time for a 503 or a partial answer (the default 2 x shard_timeout_s is the whole default deadline). An
        error raised by the shard's own code is not retried: an AndromedaError passes through, anything else is a 500
        (logged)."""
        error: BaseException | None = None
        left = remaining_s()
        budget_end = None if left is None else time.monotonic() + share * left  # all tries within it
        # a caller's deadline past the default stretches every try alike: a large batch may take longer than
        # shard_timeout_s, and a retry would pile a second pass onto the first (cancelling does not stop a pass)
        stretch = 1.0 if left is None else max(1.0, left / self.config.overload.request_timeout_s)
        for attempt in range(attempts):
            remaining_s()  # DeadlineExceeded rather than another try once the request's deadline passed
            timeout = timeout_s or self.config.shard_timeout_s * stretch
            if budget_end is not None:
                timeout = min(timeout, max(0.0, budget_end - time.monotonic()) / (attempts - attempt))
            response = getattr(self.shards[shard], method).remote(*args)
            try:
                answer = await asyncio.wait_for(response, timeout)
                if isinstance(answer, Mismatch):
                    raise ShardMismatch(f"shard {shard} serves {answer.identity}; this router serves {self.identity}: "
                                        "retry once the rollout is done", f"shard {shard}")
                return answer
            except asyncio.CancelledError:
                response.cancel()
                raise
            except BackPressureError:  # the bounded queue for this shard is full: fail fast, do not pile on
                raise Overloaded(f"shard {shard}'s queue is full (overload.shard_queue = {self.config.overload.shard_queue});"
                                 " retry after Retry-After", f"shard {shard}") from None
            except AndromedaError as exc:  # the shard's answer (e.g. NotFound), not a failure to answer
                raise getattr(exc, "cause", exc) from None
            except (TimeoutError, RayActorError, grpc.aio.AioRpcError, DeploymentUnavailableError,
                    ReplicaUnavailableError) as exc:  # no answer in time, a dead or unreachable replica, a broken gRPC
                # call, a shard deployment that failed to deploy (its replicas never started): try again
                response.cancel()
                error = exc
            except Exception as exc:  # a bug in the shard's code (as raised over gRPC, a RayTaskError by reference):
                log.error("shard %d %s failed: %r", shard, method, exc)  # retrying would only repeat it
                raise RuntimeError(f"shard {shard} failed") from None
        remaining_s()  # a call cut short by the request's deadline is that, not an unavailable shard
        raise ShardUnavailable(f"shard {shard} did not answer ({type(error).__name__}); retry later", f"shard {shard}")

    def merge(self, requests: Sequence[RetrieveRequest], compiled: Sequence[CompiledRequest],
              answers: Sequence[ShardAnswer | Missing], unreachable: dict[int, Missing],
              started: float) -> list[RetrieveResponse]:
        """Exact merge of the shards' partial top-k; eligible counts add up. Shards that did not answer
        the search or the history lookup are listed as missing. With no answer at all: Overloaded when every
        shard's queue was full, else ShardUnavailable."""
        present = {s: a for s, a in enumerate(answers) if not isinstance(a, Missing)}
        missing = sorted(set(unreachable) | (set(range(len(answers))) - set(present)))
        if not present:
            if answers and all(isinstance(a.error, Overloaded) for a in answers):
                raise Overloaded("every shard's queue is full; retry after Retry-After", "shard")
            raise ShardUnavailable("no shard answered", "shard")
        merged = merge_topks([a.topk for a in present.values()], max(r.k for r in requests))
        for s, a in present.items():
            self.metrics.shard_latency.labels(str(s)).observe(a.search_ms / 1000)
        self.metrics.eligible.inc(int(merged.eligible.sum()))
        self.metrics.scanned.inc(len(requests) * sum(a.scanned for a in present.values()))
        watermarks = [present[s].watermark if s in present else None for s in range(len(answers))]
        took_ms = round((time.perf_counter() - started) * 1000, 3)
        out = []
        for b, (r, c) in enumerate(zip(requests, compiled)):
            out.append(RetrieveResponse(
                ads=merged.row(b, r.k), eligible=int(merged.eligible[b]), index_watermark=oldest(watermarks),
                shard_watermarks=watermarks, missing_shards=missing, took_ms=took_ms, warnings=c.warnings))
        return out

    # -- ads -------------------------------------------------------------------------------------

    @app.post("/v1/ad-events", response_model=PublishResponse, responses=WRITE_ERRORS)
    async def publish(self, events: Annotated[list[AdEvent], Field(min_length=1)],
                      principal: Principal = Depends(writer)) -> PublishResponse:
        """Validate, compile and append ad events (all or nothing); needs `Authorization: Bearer <token>`: an
        admin token writes any ad, an advertiser's token only that advertiser's ads (403 otherwise)."""
        started = time.perf_counter()
        lift_deadline()  # writes are not bound by X-Request-Timeout-Ms: an advertiser's owners lookup was cut by it
        if len(events) > self.config.max_events_per_request:
            raise InvalidInput(f"at most {self.config.max_events_per_request} events per request "
                               f"(max_events_per_request), got {len(events)}", "body")
        where = [f"[{i}]" for i in range(len(events))]
        async with self.writes.slot() as slot:  # before the owner lookups: a refused write costs the shards nothing
            writer = await self.writer_of(principal, events)

            def write() -> list[str]:  # on a thread of the write path's own (self.writes), each Redis step bounded
                if writer.advertiser is not None:  # before the batch is embedded: a refusal costs no ad tower
                    try:
                        self.publisher.check_writer(events, writer, where)
                    except redis.RedisError as exc:  # the check appends nothing
                        raise StreamUnavailable(f"the update stream is unavailable ({type(exc).__name__}) while the "
                                                "batch's owners were checked; nothing of the batch was appended: retry "
                                                "it", "redis") from None
                ops = prepare_ops(self.schema, self.scorer, events, where)
                return self.publisher.publish_ops(ops, writer, where, checked=True,  # on_appended: each shard's part
                                                  on_appended=self.metrics.published.inc)  # as appended

            try:
                ids = await slot.run(write)
            except redis.RedisError as exc:
                raise StreamUnavailable(f"the update stream is unavailable ({type(exc).__name__}); some or all of the "
                                        "batch may have been appended all the same: retry the whole batch (re-sent "
                                        "events are harmless: they apply by version)", "redis") from None
        self.answered("ad_events", started)
        return PublishResponse(ids=ids)

    def answered(self, endpoint: str, started: float) -> None:
        """Counts an answered request of endpoint and its whole time (the retrievals also time their stages)."""
        self.metrics.stage(endpoint, "total", time.perf_counter() - started)
        self.metrics.requests.labels(endpoint).inc()

    async def writer_of(self, principal: Principal, events: Sequence[AdEvent]) -> Writer:
        """Who appends `events`: an admin, or an advertiser whose upserts must name it (Forbidden naming the event
        otherwise), with the owners and versions the index reports for the ads (read from one replica of each
        shard), which the owner registry takes where newer than its entry (owners.APPEND decides). An admin's
        write does not wait for the shards."""
        if principal.role != "advertiser":
            return ADMIN
        mine = principal.advertiser_id
        for i, event in enumerate(events):
            if isinstance(event, UpsertEvent) and event.ad.advertiser_id != mine:
                raise Forbidden(f"token {principal.name} writes only advertiser {mine}'s ads", f"[{i}].ad.advertiser_id")
        ids = sorted({e.ad.ad_id if isinstance(e, UpsertEvent) else e.ad_id for e in events})
        by_shard: dict[int, list[int]] = {}
        for ad_id in ids:
            by_shard.setdefault(shard_of(ad_id, len(self.shards)), []).append(ad_id)
        replies = await asyncio.gather(*(self.call(s, "owners", shard_ids) for s, shard_ids in by_shard.items()))
        return Writer(mine, {ad_id: tuple(state) for shard_ids, reply in zip(by_shard.values(), replies)
                             for ad_id, state in zip(shard_ids, reply)})

    @app.head("/v1/ads/{ad_id}", include_in_schema=False)  # whether it is indexed: 200 or 404, no body
    @app.get("/v1/ads/{ad_id}", response_model=AdState, responses=ERRORS)
    async def get_ad(self, ad_id: AD_ID, _: Principal | None = Depends(reader)) -> AdState:
        """The indexed state of one ad: version, status, shard, satisfiable, servable now."""
        started = time.perf_counter()
        shard = shard_of(ad_id, len(self.shards))
        state = await self.call(shard, "get_ad", ad_id, int(time.time()))
        if state is None:
            raise NotFound(f"ad {ad_id} is not in the index", "ad_id")
        self.answered("ad", started)
        return AdState(**state)

    # -- operations ------------------------------------------------------------------------------

    async def shard_status(self) -> list[dict | None]:
        """Each shard's status (None: it did not answer). A shard whose queue is full is busy, not gone: its last
        status stands, marked "overloaded" (the status call waits in the same queue as searches; when it failed,
        every router's /readyz failed at once, so the Ingress dropped them all, and /metrics lost its scrape)."""
        async def one(shard: int) -> dict | None:
            try:  # probes and scrapes have short deadlines of their own: answer within 2 s
                status = await self.call(shard, "status", attempts=1, timeout_s=2.0)
            except ShardUnavailable:
                return None
            except Overloaded:
                last = self.last_status.get(shard)
                return None if last is None else {**last, "overloaded": True}
            self.last_status[shard] = status
            return status
        return list(await asyncio.gather(*(one(s) for s in range(len(self.shards)))))

    @app.head("/healthz", include_in_schema=False)  # load balancers' checks often send HEAD
    @app.get("/healthz", response_model=Health)
    async def healthz(self) -> Health:
        """The router is up (Serve restarts unhealthy shard replicas by their own check_health)."""
        return Health(status="ok")

    @app.head("/readyz", include_in_schema=False)
    @app.get("/readyz", response_model=Health, responses={503: {"model": Health}})
    async def readyz(self):
        """200 once every shard answers, has caught up with its stream and serves the router's model and schema."""
        shards = [self.readiness(i, s) for i, s in enumerate(await self.shard_status())]
        ready = all(s["ready"] for s in shards)
        body = Health(status="ready" if ready else "not ready", shards=shards)
        return body if ready else json_response(503, body)

    def readiness(self, shard: int, status: dict | None) -> dict:
        """A shard's status as /readyz shows it: not ready where it did not answer, or serves another model or schema
        than the router (a shard of before 2026-12-06 reports no identity: not checked)."""
        if status is None:
            return {"shard": shard, "ready": False, "reason": "unreachable"}
        if status.get("identity", self.identity) != self.identity:
            return {**status, "ready": False, "reason": f"serves {status['identity']}; the router {self.identity}"}
        return status

    @app.head("/metrics", include_in_schema=False)
    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics(self) -> Response:
        """Prometheus text format: latency by stage, counts, per-shard index size, lag, dead letters; a shard's ready as
        /readyz judges it (0 for one serving another model or schema: the gauge said 1 while /readyz failed)."""
        shards = [self.readiness(i, s) for i, s in enumerate(await self.shard_status())]
        return Response(self.metrics.render(shards), media_type="text/plain; version=0.0.4")

