"""A shard replica whose consumer cannot read its stream (Redis killed, hung or refusing it) reports its update path
down once `stream_down_s` has passed: `/readyz` stays 200 (the replica serves what it applied; taking every replica out
of the load balancer because Redis is down would turn a write outage into a read outage), its shard's body says
`stream_up: false` and why, `andromeda_shard_stream_up` is 0 and `andromeda_shard_stream_read_age_seconds` counts
the seconds since the last read; a replica that was behind when Redis went away is not failed for the entries
waiting on Redis (a replacement could not start without it). Once Redis answers again, all of it clears. Until
2026-12-06 nothing did: `/readyz` 200 with reason "ok" and `andromeda_shard_lag_seconds` 0, only `errors` and
`last_error` moved.

A real consumer on a private redis-server (never the session's: it is killed and stopped here), a real
ShardReplica's `status` and `check_health` over it (built without Ray), and the router's app driven through ASGI
(tests/integration/test_hung_redis.py)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
import redis

from andromeda_core.index import AdIndex
from deployments.config import ServiceConfig
from deployments.shard import ShardReplica
from index_updater.consumer import ShardConsumer, consumer_client
from index_updater.local_redis import LocalRedis
from index_updater.publisher import Publisher
from tests.conftest import upsert
from tests.integration.test_hung_redis import asgi, router_on

STREAM = "down"
BOUND_S = 1.0  # stream_down_s here (default 10 s, floor 1 s): how long a replica may go unread before it says so


class ReplicaHandle:
    """A shard handle (as the router uses it) whose `status` is the replica's own."""

    def __init__(self, replica: ShardReplica):
        self.replica = replica

    def options(self, **_) -> "ReplicaHandle":
        return self

    @property
    def status(self) -> SimpleNamespace:
        async def answer() -> dict:
            return self.replica.status()
        return SimpleNamespace(remote=answer)


@pytest.fixture
def update_path(tmp_path, small_schema, scorer, monkeypatch) -> Iterator[SimpleNamespace]:
    """(server: the private redis-server (AOF: started again, it holds what it held), consumer: following its stream,
    replica: the ShardReplica over it, app: the router's, publisher), one ad applied."""
    server = LocalRedis(tmp_path / "redis").start()
    consumer = ShardConsumer(consumer_client(server.url), AdIndex(small_schema, scorer.dim, capacity=4), scorer.name,
                             stream=STREAM, block_ms=10)
    cls = ShardReplica.func_or_class
    replica = cls.__new__(cls)  # what ShardReplica.__init__ sets, over this consumer (no Ray, no model to load)
    replica.config = ServiceConfig(redis_url=server.url, stream=STREAM, stream_down_s=BOUND_S)
    replica.shard, replica.consumer, replica.expired = 0, consumer, 0
    replica.retriever = SimpleNamespace(scorer=scorer, index=consumer.index)
    router, app = router_on(server.url, monkeypatch, ReplicaHandle(replica), stream_down_s=BOUND_S)
    replica.identity = router.identity  # the router's model and schema (a replica's own, in a real one)
    publisher = Publisher(redis.Redis.from_url(server.url), small_schema, scorer, stream=STREAM)
    publisher.publish([upsert(1)])
    consumer.catch_up()
    consumer.start()
    try:
        yield SimpleNamespace(server=server, consumer=consumer, replica=replica, app=app, publisher=publisher)
    finally:
        consumer.stop()
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.kill()


async def readyz(app) -> tuple[int, dict]:
    """(/readyz's status, the body's one shard)."""
    got = await asgi(app, "GET", "/readyz")
    (shard,) = got.json["shards"]
    return got.status, shard


async def gauges(app) -> dict[str, float]:
    """The per-shard gauges of /metrics, by name (andromeda_shard_<name>{shard="0"})."""
    text = (await asgi(app, "GET", "/metrics")).body.decode()
    return {name: float(value) for name, value in re.findall(r'^andromeda_shard_(\w+)\{shard="0"\} (\S+)$', text, re.M)}


async def until(condition: Callable[[], "asyncio.Future"], timeout_s: float = 10.0) -> float:
    """Seconds until the awaited `condition()` holds, polled every 20 ms (AssertionError after `timeout_s`: a bound
    against hanging, not a timing claim)."""
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < timeout_s, "condition not reached"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def reported_down(u: SimpleNamespace) -> tuple[float, int, dict, dict]:
    """(seconds until the shard's /readyz body said its stream was down, /readyz's status then, the shard's body,
    the gauges)."""
    async def down() -> bool:
        return (await readyz(u.app))[1]["reason"] != "ok"
    took = await until(down)
    status, shard = await readyz(u.app)
    return took, status, shard, await gauges(u.app)


async def recovered(u: SimpleNamespace, ad_id: int) -> float:
    """Seconds until the shard reports its stream up, reason "ok", and an ad published now is applied."""
    async def up() -> bool:
        status, shard = await readyz(u.app)
        return status == 200 and shard["stream_up"] and shard["reason"] == "ok"
    took = await until(up)
    u.publisher.publish([upsert(ad_id)])
    async def applied() -> bool:
        return ad_id in u.consumer.index
    await until(applied)
    assert (await gauges(u.app))["stream_up"] == 1
    return took


def test_a_killed_redis_is_reported_past_the_bound_and_the_shard_stays_ready(update_path):
    u = update_path

    async def scenario() -> tuple[float, float]:
        status, shard = await readyz(u.app)
        assert status == 200 and shard["reason"] == "ok"
        u.server.kill()  # SIGKILL, as a crash
        took, status, shard, metrics = await reported_down(u)
        assert status == 200 and shard["ready"] and shard["healthy"] and not shard["stream_up"], shard  # serving
        assert re.match(r"stream unreachable for \d+\.\d s: ConnectionError: ", shard["reason"]), shard["reason"]
        assert float(shard["reason"].split()[3]) >= BOUND_S  # not before the bound (its one decimal rounds)
        assert metrics["stream_up"] == 0 and metrics["stream_read_age_seconds"] > BOUND_S and metrics["ready"] == 1
        assert shard["stream_read_age_seconds"] > BOUND_S
        # a replica that was behind when Redis went away: its entries wait on Redis, not on it, and a replacement
        # could not start (it must catch up first), so it stays healthy and Serve keeps it
        u.consumer.stats.behind_since = time.time() - 3600
        u.replica.check_health()
        status, shard = await readyz(u.app)
        assert status == 200 and shard["ready"] and shard["lag_seconds"] > 3000 and not shard["stream_up"]
        u.server.start()  # the same port and data directory
        return took, await recovered(u, 2)

    took, back = asyncio.run(scenario())
    print(f"killed: reported down after {took:.2f} s (bound {BOUND_S} s); up again {back:.2f} s after the restart")


def test_a_hung_redis_is_reported_past_the_bound_and_clears_when_it_answers(update_path):
    u = update_path

    async def scenario() -> tuple[float, float]:
        os.kill(u.server.process.pid, signal.SIGSTOP)  # connections accepted, nothing answered
        try:
            took, status, shard, metrics = await reported_down(u)
        finally:
            os.kill(u.server.process.pid, signal.SIGCONT)
        assert status == 200 and shard["ready"] and shard["healthy"] and not shard["stream_up"], shard
        assert re.match(r"stream unreachable for \d+\.\d s: a read has waited \d+\.\d s for Redis's reply$",
                        shard["reason"]), shard["reason"]
        assert metrics["stream_up"] == 0 and metrics["stream_read_age_seconds"] > BOUND_S
        return took, await recovered(u, 2)

    took, back = asyncio.run(scenario())
    print(f"hung: reported down after {took:.2f} s (bound {BOUND_S} s); up again {back:.2f} s after SIGCONT")


def test_a_redis_that_refuses_the_replica_is_reported_past_the_bound(update_path):
    u = update_path
    admin = redis.Redis.from_url(u.server.url)

    async def scenario() -> str:
        admin.config_set("requirepass", "rotated")  # a password the replica was not given
        redis.Redis.from_url(u.server.url, password="rotated").client_kill_filter(_type="normal", skipme=True)
        _, status, shard, metrics = await reported_down(u)
        assert status == 200 and shard["ready"] and not shard["stream_up"] and metrics["stream_up"] == 0, shard
        redis.Redis.from_url(u.server.url, password="rotated").config_set("requirepass", "")
        await recovered(u, 2)
        return shard["reason"]

    reason = asyncio.run(scenario())
    print("refused:", reason)
    assert re.match(r"stream unreachable for \d+\.\d s: AuthenticationError: ", reason), reason
