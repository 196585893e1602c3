"""The router's calls to a shard (Router.call, Router.ask) and its merge, against stand-in shard handles and answers:
what is retried (no answer in time, a dead or unreachable replica), what passes through (the shard's own
AndromedaError), what is a logged 500 and not retried (any other exception: a bug in the shard's code, as Serve raises
it over gRPC), what allow_partial leaves out. tests/integration runs the same calls through a real Ray Serve."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import ActorUnavailableError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from andromeda_core.errors import ErrorCategory, NotFound, Overloaded
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.index import AdIndex
from andromeda_core.retriever import Retriever, TopK, UserQuery, compile_requests
from andromeda_core.schema import load_schema
from andromeda_core.sharding import shard_of
from andromeda_core.types import parse_request
from deployments.api import DEADLINE
from deployments.metrics import ServiceMetrics
from deployments.config import Limits, Overload, ServiceConfig
from index_updater.consumer import ConsumerStats
from tests.conftest import apply_events, upsert
from deployments.router import Missing, Router, ShardMismatch, ShardUnavailable
from deployments.shard import HistoryVectors, Mismatch, ShardAnswer, ShardQuery, ShardReplica, serving_identity

DEFAULTS = Overload()  # request_timeout_s 10 s


class Reply:
    """What handle.method.remote() returns: awaited, it raises `error`."""

    def __init__(self, error: BaseException):
        self.error, self.cancelled = error, False

    def __await__(self):
        raise self.error
        yield  # a generator: awaitable

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A shard handle: handle.search.remote(...) is its remote(...)."""

    @property
    def search(self):
        return SimpleNamespace(remote=self.remote)


class Shard(Handle):
    """A shard handle whose every call fails with `error`; counts the calls."""

    def __init__(self, error: BaseException):
        self.error, self.replies = error, []

    def remote(self, *args) -> Reply:
        self.replies.append(Reply(self.error))
        return self.replies[-1]


def call(error: BaseException) -> tuple[Shard, BaseException]:
    shard = Shard(error)
    router = SimpleNamespace(shards=[shard], config=SimpleNamespace(shard_timeout_s=5.0, overload=DEFAULTS))
    with pytest.raises(Exception) as raised:
        asyncio.run(Router.func_or_class.call(router, 0, "search", "query", attempts=2))
    return shard, raised.value


@pytest.mark.parametrize("error", [TimeoutError(), ActorUnavailableError("gone", b"\0" * 16),
                                   DeploymentUnavailableError(DeploymentID(name="shard-0", app_name="andromeda")),
                                   ReplicaUnavailableError("replica-abc")])
def test_no_answer_or_a_dead_replica_is_asked_again_then_named_unavailable(error):
    """A shard deployment that failed to deploy (Serve raises DeploymentUnavailableError) was a logged 500, not a
    shard to leave out with allow_partial."""
    shard, raised = call(error)
    assert len(shard.replies) == 2 and all(r.cancelled for r in shard.replies)
    assert isinstance(raised, ShardUnavailable) and raised.field == "shard 0" and type(error).__name__ in raised.message


class Silent(Handle):
    """A shard handle whose calls never answer (a shard with no live replica); counts the calls."""

    def __init__(self):
        self.calls = 0

    def remote(self, *args):
        self.calls += 1
        return asyncio.get_running_loop().create_future()  # never set; cancelled by the timeout


def test_the_tries_give_up_in_time_for_a_503_or_a_partial_answer():
    """Two tries of shard_timeout_s each would end exactly at the request's deadline (as with the defaults, 2 x 5 s and
    10 s), and the request would be a 504: the tries share what the deadline leaves, so the shard is named unavailable
    (or, with allow_partial, left out) with time to answer."""
    shard = Silent()
    router = SimpleNamespace(shards=[shard], config=SimpleNamespace(shard_timeout_s=0.5, overload=DEFAULTS))
    router.call = lambda *args, **kwargs: Router.func_or_class.call(router, *args, **kwargs)

    async def ask(allow_partial: bool):
        DEADLINE.set(time.time() + 1.0)
        started = time.time()
        try:
            return await Router.func_or_class.ask(router, 0, allow_partial, "search", "query"), time.time() - started
        except ShardUnavailable as exc:
            return exc, time.time() - started

    (unavailable, took), (left_out, _) = asyncio.run(ask(False)), asyncio.run(ask(True))
    assert isinstance(unavailable, ShardUnavailable) and 0.85 <= took < 0.97, took  # ANSWER_SHARE of the deadline
    assert isinstance(left_out, Missing) and type(left_out.error) is ShardUnavailable
    assert shard.calls == 4  # two tries each


class Slow(Handle):
    """A shard handle whose calls answer after `seconds` (a large batch's pass); counts the calls."""

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, 0

    def remote(self, *args):
        self.calls += 1
        return asyncio.ensure_future(asyncio.sleep(self.seconds, result="answer"))


def test_a_longer_deadline_than_the_default_stretches_each_try():
    """A 256 x 10,000 batch takes longer than shard_timeout_s: its caller's 60 s deadline bought two tries of 5 s
    each, the second piling another pass onto the first, and a 503 half the time. A try now lasts shard_timeout_s
    times the request's deadline over the default one; with the default deadline it is as before."""
    def ask(deadline_s: float):
        shard = Slow(0.3)
        router = SimpleNamespace(shards=[shard], config=SimpleNamespace(
            shard_timeout_s=0.2, overload=SimpleNamespace(request_timeout_s=1.0)))

        async def run():
            DEADLINE.set(time.time() + deadline_s)
            try:
                return await Router.func_or_class.call(router, 0, "search", "query")
            except ShardUnavailable as exc:
                return exc
        return asyncio.run(run()), shard.calls

    assert ask(3.0) == ("answer", 1)  # tries of 0.2 x 3 = 0.6 s
    unavailable, calls = ask(1.0)  # the default deadline: tries of 0.2 s, as before
    assert isinstance(unavailable, ShardUnavailable) and calls == 2


def test_the_shards_own_error_passes_through_once():
    shard, raised = call(NotFound("ad 7 is not indexed", "ad_id"))
    assert len(shard.replies) == 1 and isinstance(raised, NotFound) and raised.field == "ad_id"


def test_a_bug_in_the_shard_is_a_logged_500_and_not_retried(caplog):
    with caplog.at_level(logging.ERROR, logger="deployments.router"):
        shard, raised = call(ValueError("index out of range"))
    assert len(shard.replies) == 1
    assert type(raised) is RuntimeError and str(raised) == "shard 0 failed"
    assert "shard 0 search failed: ValueError('index out of range')" in caplog.text


class Answer:
    """What handle.status.remote() returns: awaited, `value`, or it raises `error`."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.value
        yield  # a generator: awaitable

    def cancel(self) -> None:
        pass


def test_a_busy_shard_keeps_its_last_status_for_probes_and_scrapes():
    """The status call waits in the shard's queue like a search: a full queue (Overloaded) keeps the shard's last
    status, marked overloaded; never answered before, or gone (no answer in time), it is None (unreachable)."""
    answers = [Answer({"shard": 0, "ready": True}), Answer(error=BackPressureError(num_queued_requests=3,
                                                                                  max_queued_requests=3)),
               Answer(error=TimeoutError())]
    shard = SimpleNamespace(status=SimpleNamespace(remote=lambda: answers.pop(0)))
    router = SimpleNamespace(shards=[shard], config=SimpleNamespace(shard_timeout_s=5.0, overload=SimpleNamespace(
        shard_queue=3)), last_status={})
    router.call = lambda *args, **kwargs: Router.func_or_class.call(router, *args, **kwargs)
    status = [asyncio.run(Router.func_or_class.shard_status(router))[0] for _ in range(3)]
    assert status == [{"shard": 0, "ready": True}, {"shard": 0, "ready": True, "overloaded": True}, None]
    busy = SimpleNamespace(**{**vars(router), "last_status": {}})
    answers.append(Answer(error=BackPressureError(num_queued_requests=3, max_queued_requests=3)))
    assert asyncio.run(Router.func_or_class.shard_status(busy)) == [None]


@pytest.mark.parametrize("error", [TimeoutError(), BackPressureError(num_queued_requests=3, max_queued_requests=3)])
def test_allow_partial_leaves_out_a_shard_that_does_not_answer_or_is_full(error):
    """With allow_partial, a shard that does not answer or whose queue is full gives Missing(why) (listed missing);
    without it, the request fails: ShardUnavailable, Overloaded."""
    router = SimpleNamespace(shards=[Shard(error)], config=SimpleNamespace(shard_timeout_s=5.0, overload=SimpleNamespace(
        shard_queue=3)))
    router.call = lambda *args, **kwargs: Router.func_or_class.call(router, *args, **kwargs)
    why = ShardUnavailable if isinstance(error, TimeoutError) else Overloaded
    left_out = asyncio.run(Router.func_or_class.ask(router, 0, True, "search", "query"))
    assert isinstance(left_out, Missing) and type(left_out.error) is why
    with pytest.raises(why):
        asyncio.run(Router.func_or_class.ask(router, 0, False, "search", "query"))


def test_allow_partial_does_not_hide_a_shards_own_error():
    router = SimpleNamespace(shards=[Shard(NotFound("ad 7 is not indexed", "ad_id"))],
                             config=SimpleNamespace(shard_timeout_s=5.0, overload=DEFAULTS))
    router.call = lambda *args, **kwargs: Router.func_or_class.call(router, *args, **kwargs)
    with pytest.raises(NotFound):
        asyncio.run(Router.func_or_class.ask(router, 0, True, "search", "query"))


def test_the_merge_lists_shards_missing_from_the_search_or_the_history_lookup():
    """Shard 1 gave no answer (allow_partial): the response is shard 0's top-k and lists shard 1, and shard 2, which
    missed the history lookup though its search answered. No shard answering at all is Overloaded when every shard's
    queue was full, else ShardUnavailable."""
    requests = [parse_request({"user": {"user_id": 1}, "k": 2})]
    compiled = compile_requests(load_schema(), requests)

    def part(ids, scores, eligible, watermark):
        return ShardAnswer(TopK(torch.tensor([ids]), torch.tensor([scores]), torch.tensor([eligible])), watermark, 1.0, 10)

    router = SimpleNamespace(metrics=ServiceMetrics())
    unavailable, full = Missing(ShardUnavailable("no answer", "shard 1")), Missing(Overloaded("full", "shard 1"))
    answers = [part([4, 6], [0.5, 0.25], 7, "5-0"), unavailable, part([9, -1], [0.75, float("-inf")], 1, "3-0")]
    response = Router.func_or_class.merge(router, requests, compiled, answers, {2: unavailable}, 0.0)[0]
    assert [(a.ad_id, a.score) for a in response.ads] == [(9, 0.75), (4, 0.5)] and response.eligible == 8
    assert response.missing_shards == [1, 2] and response.shard_watermarks == ["5-0", None, "3-0"]
    with pytest.raises(ShardUnavailable):
        Router.func_or_class.merge(router, requests, compiled, [full, unavailable], {}, 0.0)
    with pytest.raises(Overloaded, match="every shard's queue is full"):
        Router.func_or_class.merge(router, requests, compiled, [full, full], {}, 0.0)


class Healthy:
    """A shard handle that answers at once: no history ad indexed, a top-k of ad 4."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method: str):
        async def answer(*args):
            self.calls.append(method)
            if method == "vectors":
                return HistoryVectors(torch.zeros((len(args[0]), 16)), torch.zeros(len(args[0]), dtype=torch.bool))
            return ShardAnswer(TopK(torch.tensor([[4]]), torch.tensor([[0.5]]), torch.tensor([3])), "1-0", 1.0, 10)
        return SimpleNamespace(remote=lambda *args: answer(*args))


def test_a_dead_shard_owning_history_ads_leaves_the_search_time_for_a_partial_answer():
    """The history lookup's tries at a shard with no live replica took 90% of what the deadline left, and the searches
    got the rest: a request allowing a partial answer was a 503 though the other shard was healthy. The lookup now
    takes at most HISTORY_SHARE of it, and a shard that missed it is not searched (it is listed as missing)."""
    healthy, dead = Healthy(), Silent()
    dead.vectors = dead.search  # never answers either call
    scorer = HashedTwoTower(dim=16, buckets=64)
    router = SimpleNamespace(shards=[healthy, dead], scorer=scorer, schema=load_schema(), metrics=ServiceMetrics(),
                             config=SimpleNamespace(shard_timeout_s=5.0, max_batch_size=16, limits=Limits(), overload=DEFAULTS),
                             identity="model m, schema s")
    for name in ("compiled", "history_lookup", "ask", "call", "merge", "answered"):
        setattr(router, name, functools.partial(getattr(Router.func_or_class, name), router))
    on_dead = next(a for a in range(1, 100) if shard_of(a, 2) == 1)
    request = parse_request({"user": {"user_id": 1, "history": [{"ad_id": on_dead, "event": "click", "ts": 5}]},
                             "context": {"ts": 100}, "k": 1, "allow_partial": True})

    async def answer():  # the deadline set in the task's own context (set here, it would outlive the test)
        DEADLINE.set(time.time() + 1.0)
        return (await Router.func_or_class.answer(router, [request], "retrieve", ""))[0]

    started = time.time()
    response = asyncio.run(answer())
    assert [a.ad_id for a in response.ads] == [4] and response.missing_shards == [1]
    assert time.time() - started < 0.6 and dead.calls == 2 and healthy.calls == ["search"]  # 2 tries: the lookup


class Serving:
    """A shard handle that answers every call with `answer` (awaited at once)."""

    def __init__(self, answer):
        self.answer = answer

    def __getattr__(self, method: str):
        async def reply(*args):
            return self.answer
        return SimpleNamespace(remote=lambda *args: reply(*args))


def test_a_shard_of_another_model_or_schema_is_refused_not_read():
    """Router and shards embed and compile under their own model and schema: a shard serving others (a rollout half
    done) answered as if they were the router's, and its scores or matches were wrong without a word. Its Mismatch
    answer is a 503 naming both, and allow_partial leaves the shard out."""
    router = SimpleNamespace(shards=[Serving(Mismatch("model b, schema s"))], config=SimpleNamespace(shard_timeout_s=5.0, overload=DEFAULTS),
                             identity="model a, schema s")
    router.call = functools.partial(Router.func_or_class.call, router)
    with pytest.raises(ShardMismatch, match="shard 0 serves model b, schema s; this router serves model a") as raised:
        asyncio.run(Router.func_or_class.ask(router, 0, False, "search", "query"))
    assert raised.value.category == ErrorCategory.UNAVAILABLE
    left_out = asyncio.run(Router.func_or_class.ask(router, 0, True, "search", "query"))
    assert isinstance(left_out, Missing) and isinstance(left_out.error, ShardMismatch)


def test_readiness_needs_every_shard_to_serve_the_routers_model_and_schema():
    ours = {"shard": 0, "ready": True, "identity": "model a, schema s"}
    theirs = {"shard": 1, "ready": True, "identity": "model b, schema s"}

    async def statuses():
        return [ours, theirs]

    router = SimpleNamespace(shard_status=statuses, identity="model a, schema s")
    router.readiness = functools.partial(Router.func_or_class.readiness, router)
    answer = asyncio.run(Router.func_or_class.readyz(router))
    body = json.loads(answer.body)
    assert answer.status_code == 503 and body["shards"][0] == ours
    assert body["shards"][1]["ready"] is False and body["shards"][1]["reason"] == "serves model b, schema s; the router model a, schema s"
    router.metrics = ServiceMetrics()
    text = asyncio.run(Router.func_or_class.prometheus_metrics(router)).body.decode()
    assert 'andromeda_shard_ready{shard="0"} 1.0' in text and 'andromeda_shard_ready{shard="1"} 0.0' in text  # as
    # /readyz: the gauge said 1, and no alert fired while every pod failed readiness
    theirs.pop("identity")  # a shard of before identities reports none: not a mismatch
    assert asyncio.run(Router.func_or_class.readyz(router)).status == "ready"


def test_a_shard_answers_a_query_of_another_identity_with_mismatch_and_the_rest_of_its_batch_as_usual(small_schema):
    """One router of another model in a shard's batched pass must not fail the queries of the others."""
    scorer = HashedTwoTower(dim=16, buckets=64)
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i) for i in (1, 2, 3)])
    cls = ShardReplica.func_or_class
    replica = cls.__new__(cls)  # what ShardReplica.__init__ sets (no Ray, no stream)
    replica.retriever, replica.expired, replica.config = Retriever(index, scorer), 0, ServiceConfig()
    replica.consumer = SimpleNamespace(stats=ConsumerStats(), clock_s=lambda: 100, stop=lambda: None)
    replica.identity = serving_identity(scorer.name, small_schema)
    request = parse_request({"user": {"user_id": 1}, "context": {"ts": 100}, "k": 2})
    users = scorer.encode_users([request], index.embeddings_of, [100])
    query = UserQuery(users, [compile_requests(small_schema, [request])[0].values], [100], [2])
    ours, theirs = ShardQuery(query, None, replica.identity), ShardQuery(query, None, "model other, schema s")
    answers = asyncio.run(cls._pass(replica, [theirs, ours, theirs]))
    assert answers[0] == answers[2] == Mismatch(replica.identity) and replica.expired == 0
    assert isinstance(answers[1], ShardAnswer) and answers[1].topk.ids.shape == (1, 2)
    assert cls.vectors(replica, [1], "model other, schema s") == Mismatch(replica.identity)
    assert cls.vectors(replica, [1], replica.identity).found.tolist() == [True]
    older = asyncio.run(cls._pass(replica, [ShardQuery(query, None)]))[0]  # a router of before identities: unchecked
    assert isinstance(older, ShardAnswer) and cls.vectors(replica, [1]).found.tolist() == [True]
    apply_events(index, scorer, [upsert(4, start_time=0, end_time=150)])  # ends by Redis's clock, not the host's
    assert cls.vectors(replica, [4]).found.tolist() == [True]  # Redis's clock (as last read) at 100
    replica.consumer.clock_s = lambda: 150
    assert cls.vectors(replica, [4]).found.tolist() == [False]
