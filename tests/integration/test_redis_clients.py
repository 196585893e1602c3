"""index_updater.clients.redis_client against a real redis-server of the test's own: a new connection sends no
CLIENT SETINFO or MAINT_NOTIFICATIONS (redis-py's defaults, each a reply to wait for), and a try that finds Redis hung
ends after one wait, not retried by redis-py."""
from __future__ import annotations

import time

import pytest
import redis

from index_updater.clients import redis_client
from index_updater.local_redis import LocalRedis
from tests.integration.conftest import hung


def handshake_extras_seen(admin: redis.Redis) -> int:
    """CLIENT SETINFO and CLIENT MAINT_NOTIFICATIONS commands the server has seen: taken (where it knows them) or
    refused (an ERR: Redis 7.0 knows neither)."""
    stats = admin.info("commandstats")
    taken = sum(stats.get(f"cmdstat_client|{sub}", {}).get("calls", 0) for sub in ("setinfo", "maint_notifications"))
    return taken + admin.info("errorstats").get("errorstat_ERR", {}).get("count", 0)


def test_a_new_connection_sends_no_more_than_it_needs(private_redis: LocalRedis):
    """Each command of a connection's handshake is one more reply a try waits for."""
    admin = redis_client(private_redis.url, 5.0)
    admin.ping()
    before = handshake_extras_seen(admin)
    redis.Redis.from_url(private_redis.url).ping()  # redis-py's defaults: the probe sees them
    by_default = handshake_extras_seen(admin) - before
    assert by_default >= 2
    redis_client(private_redis.url, 5.0).ping()
    assert handshake_extras_seen(admin) - before == by_default


@pytest.mark.parametrize("connected", [False, True])
def test_a_try_on_a_hung_redis_ends_after_one_wait(private_redis: LocalRedis, connected: bool):
    """On a new connection (the kernel accepts it, nothing answers) and on one made before: a TimeoutError after one
    wait of wait_s; a retry by redis-py would wait at least as long again."""
    wait_s, client = 0.5, redis_client(private_redis.url, 0.5)
    if connected:
        client.ping()
    with hung(private_redis):
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        took = time.monotonic() - started
    assert wait_s <= took < 2 * wait_s, took
