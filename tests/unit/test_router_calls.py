"""The router's calls to a shard (Router.call), error paths only, against a stand-in shard handle: what is retried
(no answer in time, a dead or unreachable replica), what passes through (the shard's own AndromedaError), what is a
logged 500 and not retried (any other exception: a bug in the shard's code, as Serve raises it over gRPC).
tests/integration runs the same calls through a real Ray Serve."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from andromeda_core.errors import NotFound
from deployments.router import Router, ShardUnavailable


class Reply:
    """What handle.method.remote() returns: awaited, it raises `error`."""

    def __init__(self, error: BaseException):
        self.error, self.cancelled = error, False

    def __await__(self):
        raise self.error
        yield  # a generator: awaitable

    def cancel(self) -> None:
        self.cancelled = True


class Shard:
    """A shard handle whose every call fails with `error`; counts the calls."""

    def __init__(self, error: BaseException):
        self.error, self.replies = error, []

    @property
    def search(self):
        return SimpleNamespace(remote=self.remote)

    def remote(self, *args) -> Reply:
        self.replies.append(Reply(self.error))
        return self.replies[-1]


def call(error: BaseException) -> tuple[Shard, BaseException]:
    shard = Shard(error)
    router = SimpleNamespace(shards=[shard], config=SimpleNamespace(shard_timeout_s=5.0))
    with pytest.raises(Exception) as raised:
        asyncio.run(Router.func_or_class.call(router, 0, "search", "query", attempts=2))
    return shard, raised.value


@pytest.mark.parametrize("error", [TimeoutError(), ActorUnavailableError("gone", b"\0" * 16)])
def test_no_answer_or_a_dead_replica_is_asked_again_then_named_unavailable(error):
    shard, raised = call(error)
    assert len(shard.replies) == 2 and all(r.cancelled for r in shard.replies)
    assert isinstance(raised, ShardUnavailable) and raised.field == "shard 0" and type(error).__name__ in raised.message


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
