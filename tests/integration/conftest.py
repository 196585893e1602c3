from __future__ import annotations

import os

import pytest
import redis

from index_updater.local_redis import LocalRedis


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
