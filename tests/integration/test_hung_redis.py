"""A Redis that hangs (SIGSTOP: the kernel still accepts connections, nothing answers) while writes wait on it.
Retrievals must stay answered in their normal time, and the writes get a 503 within `overload.write_timeout_s`
(those past `overload.write_inflight` after a short wait for a slot). Before 2026-12-06 every write's Redis work ran in
the default thread pool that the retrievals' user towers need (6 threads on 2 cores), each for 5 tries of redis-py's
5 s socket timeout: 6 waiting writes left every retrieval waiting until their 26 s were over.

The router's own FastAPI app, driven straight through ASGI, with a private redis-server (never the session's: it is
stopped here) and a stand-in shard that answers every search at once (the shards never touch Redis on a request).
The shared rate limit is on, so that every request asks Redis too (at most `rate_limit.store_timeout_s`, then the
router's own bucket). The event loop's default pool has the 6 threads a router replica's has on the 2-core box,
whatever this machine's cores. tests/integration/test_guarded_service.py runs the same through real Ray Serve and
HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import redis
import torch
from fastapi import FastAPI
from ray import serve

from andromeda_core.retriever import TopK
from deployments.auth import add_token
from deployments.config import Auth, Overload, RateLimit, ServiceConfig
from deployments.router import Router
from deployments.shard import ShardAnswer, ShardQuery
from index_updater.publisher import Publisher
from index_updater.records import shard_stream
from tests.conftest import upsert
from tests.integration.conftest import hung

TOKEN = "admin-token-of-the-hung-redis-test"
RETRIEVE = json.dumps({"user": {"user_id": 1, "attributes": {"country": "US"}}, "k": 5}).encode()
REPLICA_POOL = 6  # the default pool of a router replica on 2 cores: min(32, cpu_count + 4)


class StandInShard:
    """A shard handle (Serve's DeploymentHandle, as the router uses it) whose searches answer at once: no ad; its owner
    lookups (an advertiser's write) answer "no owner" for every ad, and are counted."""

    def __init__(self):
        self.owner_lookups = 0

    def options(self, **_) -> "StandInShard":
        return self

    @property
    def owners(self) -> SimpleNamespace:
        async def answer(ad_ids: list[int]) -> list[tuple[None, None, None]]:
            self.owner_lookups += 1
            return [(None, None, None)] * len(ad_ids)
        return SimpleNamespace(remote=answer)

    @property
    def search(self) -> SimpleNamespace:
        async def answer(query: ShardQuery) -> ShardAnswer:
            rows, k = len(query), max(query.query.k)
            return ShardAnswer(TopK(torch.full((rows, k), -1, dtype=torch.int64),
                                    torch.full((rows, k), float("-inf")), torch.zeros(rows, dtype=torch.int64)),
                               None, 0.1, 0)
        return SimpleNamespace(remote=answer)


async def asgi(app, method: str, path: str, body: bytes = b"", token: str | None = None) -> SimpleNamespace:
    """One request straight to the ASGI app -> (status, headers (lower-case names), json, seconds it took)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "server": ("router", 80), "client": ("caller", 1)}
    got = SimpleNamespace(status=0, headers={}, body=b"")

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            got.status = message["status"]
            got.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            got.body += message.get("body", b"")

    started = time.monotonic()
    await app(scope, receive, send)
    got.seconds = time.monotonic() - started
    got.json = json.loads(got.body) if got.headers.get("content-type") == "application/json" else None
    return got


def router_on(url: str, monkeypatch, shard=None, **config) -> tuple[Router, FastAPI]:
    """A Router replica of one shard (`shard`: its handle; default StandInShard()) built without Ray, and its app,
    whose routes resolve `self` to it."""
    monkeypatch.setenv("ANDROMEDA_WRITE_TOKEN", TOKEN)
    cls = Router.func_or_class.__bases__[0]  # the class as written (Serve's wrapper adds the ASGI plumbing)
    router = cls.__new__(cls)
    cls.__init__(router, ServiceConfig(redis_url=url, stream="hung", **config).model_dump(mode="json"),
                 shard or StandInShard())
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=router))
    return router, cls.__init__.__globals__["app"]  # Serve pickled the class by value with its app: this one


def write(ad_id: int, advertiser: int | None = None) -> bytes:
    event = upsert(ad_id)
    if advertiser is not None:
        event["ad"]["advertiser_id"] = advertiser
    return json.dumps([event]).encode()


def test_a_hung_redis_leaves_retrievals_answered_and_bounds_each_write(private_redis, monkeypatch):
    """Redis hung with 8 writes sent: every retrieval meanwhile is a 200 in its normal time (well under a second;
    the writes wait 2 s); the 4 writes of `write_inflight` get 503 unavailable, saying that the batch may have
    been appended, within `write_timeout_s`, the other 4 a 503 overloaded after the short wait for a slot, all with
    Retry-After. Once Redis answers again, a write goes through."""
    async def scenario() -> tuple[list, list]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(REPLICA_POOL))
        _, app = router_on(private_redis.url, monkeypatch, overload=Overload(write_inflight=4, write_timeout_s=2.0),
                           rate_limit=RateLimit(requests_per_s=1000, burst=1000, shared=True))
        assert (await asgi(app, "POST", "/v1/retrieve", RETRIEVE)).status == 200  # warm
        assert (await asgi(app, "POST", "/v1/ad-events", write(1), TOKEN)).status == 200
        with hung(private_redis):
            writes = [asyncio.create_task(asgi(app, "POST", "/v1/ad-events", write(10 + i), TOKEN)) for i in range(8)]
            await asyncio.sleep(0.3)  # every write admitted is waiting on Redis by now
            retrievals = []
            for _ in range(5):
                retrievals.append(await asyncio.wait_for(asgi(app, "POST", "/v1/retrieve", RETRIEVE), 10))
                await asyncio.sleep(0.1)
            answered = await asyncio.wait_for(asyncio.gather(*writes), 60)
        after = await asgi(app, "POST", "/v1/ad-events", write(2), TOKEN)
        assert after.status == 200, after.json
        return retrievals, answered

    retrievals, answered = asyncio.run(scenario())
    print("retrievals (s):", [round(r.seconds, 3) for r in retrievals],
          "writes (status, category, s):", [(w.status, w.json["error"]["category"], round(w.seconds, 2))
                                             for w in answered])
    assert [r.status for r in retrievals] == [200] * 5 and max(r.seconds for r in retrievals) < 0.5
    unavailable = [w for w in answered if w.json["error"]["category"] == "unavailable"]
    overloaded = [w for w in answered if w.json["error"]["category"] == "overloaded"]
    assert len(unavailable) == 4 and len(overloaded) == 4
    assert all(w.status == 503 and w.headers["retry-after"] == "1" for w in answered)
    for w in unavailable:
        assert w.seconds <= 2.0 + 0.5 and w.json["error"]["field"] == "redis"
        assert "may have been appended" in w.json["error"]["message"]
    for w in overloaded:
        assert w.seconds < 0.5 and "overload.write_inflight" in w.json["error"]["message"]


def test_a_stall_longer_than_half_the_bound_ends_in_the_resend(private_redis, small_schema, scorer):
    """Redis stalls (SIGSTOP) for 0.65 of the publisher's bound while it appends an event: the first try times out,
    and the resend, made within the bound, returns the entry that Redis appended late for the first try (it carries
    that try's token): the write succeeds, and the stream holds it once. Before 2026-12-06's review each try waited
    half the bound, no resend fitted after a timed-out one, and this write was a TimeoutError (a 503 at the router)
    although Redis had appended it."""
    bound_s = 2.0
    bounded = Publisher.bounded(private_redis.url, small_schema, scorer, bound_s, stream="stall", attempts=5)
    assert len(bounded.publish([upsert(1)])) == 1  # connected, the script loaded
    stream = redis.Redis.from_url(private_redis.url)
    with hung(private_redis):
        resumed = threading.Timer(0.65 * bound_s, lambda: os.kill(private_redis.process.pid, signal.SIGCONT))
        started = time.monotonic()  # before the timer starts, so the write ends at least 0.65 of the bound after
        resumed.start()  # (a clock read after the start failed the bound below by 0.7 ms on a loaded box)
        ids = bounded.publish([upsert(2)])
        took = time.monotonic() - started
        resumed.join()
    entries = stream.xrange(shard_stream("stall", 0))
    assert len(entries) == 2 and ids == [entries[1][0].decode()], (ids, entries)
    assert 0.65 * bound_s <= took <= bound_s + 0.5, took


def advertiser_router(url: str, monkeypatch, tmp_path, overload: Overload) -> tuple[StandInShard, FastAPI, str]:
    """A router (one stand-in shard) with a token file holding advertiser 7's token -> (shard, app, token)."""
    tokens, shard = tmp_path / "tokens.json", StandInShard()
    token = add_token(tokens, "acme", "advertiser", 7)
    _, app = router_on(url, monkeypatch, shard, overload=overload, auth=Auth(token_file=str(tokens)))
    return shard, app, token


def test_an_owner_check_that_finds_redis_hung_says_nothing_was_appended(private_redis, monkeypatch, tmp_path):
    """An advertiser's write whose owner check (the first Redis step, which appends nothing) times out gets 503
    unavailable saying that nothing of the batch was appended, not that some may have been; once Redis answers, the
    stream holds nothing of it."""
    async def scenario():
        _, app, token = advertiser_router(private_redis.url, monkeypatch, tmp_path, Overload(write_timeout_s=1.0))
        assert (await asgi(app, "POST", "/v1/ad-events", write(1, advertiser=7), token)).status == 200
        with hung(private_redis):
            return await asyncio.wait_for(asgi(app, "POST", "/v1/ad-events", write(2, advertiser=7), token), 10)

    refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.json["error"]["category"] == "unavailable", refused.json
    message = refused.json["error"]["message"]
    assert "nothing of the batch was appended" in message and "may have been appended" not in message
    assert refused.seconds <= 1.0 + 0.5
    assert redis.Redis.from_url(private_redis.url).xlen(shard_stream("hung", 0)) == 1


def test_a_write_refused_for_want_of_a_slot_costs_the_shards_nothing(private_redis, monkeypatch, tmp_path):
    """write_inflight 1, taken by a write waiting on a hung Redis: an advertiser's write is refused (503 overloaded,
    after the short wait for a slot) before its owner lookups, so the shards are not asked (they were, before the
    refusal, until 2026-12-06's review)."""
    async def scenario():
        shard, app, token = advertiser_router(private_redis.url, monkeypatch, tmp_path,
                                              Overload(write_inflight=1, write_timeout_s=1.0))
        with hung(private_redis):
            waiting = asyncio.create_task(asgi(app, "POST", "/v1/ad-events", write(1), TOKEN))
            await asyncio.sleep(0.2)
            refused = await asyncio.wait_for(asgi(app, "POST", "/v1/ad-events", write(2, advertiser=7), token), 10)
            await asyncio.wait_for(waiting, 10)
        return shard, refused

    shard, refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.json["error"]["category"] == "overloaded", refused.json
    assert "overload.write_inflight" in refused.json["error"]["message"] and shard.owner_lookups == 0
