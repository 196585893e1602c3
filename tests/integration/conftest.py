from __future__ import annotations

import os

import pytest
import redis

from andromeda_core.index import AdIndex
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis
from index_updater.publisher import Publisher


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with AOF (fsync always) on a free loopback port, or REDIS_URL's (flushed)."""
    if os.environ.get("REDIS_URL"):
        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        client.flushdb()
        yield None, client
        return
    server = LocalRedis(tmp_path / "redis").start()
    yield server, redis.Redis.from_url(server.url)
    server.stop()


@pytest.fixture
def setup(redis_server, small_schema, scorer):
    """(client, a publisher of one shard, make(shard=0, shards=1, **kwargs) -> a consumer with an empty index)."""
    _, client = redis_server

    def consumer(shard: int = 0, shards: int = 1, **kwargs) -> ShardConsumer:
        return ShardConsumer(client, AdIndex(small_schema, scorer.dim, capacity=4), scorer.name, shard, shards,
                             block_ms=10, **kwargs)

    return client, Publisher(client, small_schema, scorer), consumer
