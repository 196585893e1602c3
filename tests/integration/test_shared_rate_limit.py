"""The cluster-wide token bucket (deployments/shared_limits.py) against a real redis-server: it is the
in-process TokenBuckets' arithmetic, shared by every router that uses the same Redis; idle buckets
expire; without Redis each router falls back to its own bucket and counts it."""
from __future__ import annotations

import logging
import socket
import uuid

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deployments.config import RateLimit, ServiceConfig
from deployments.limits import TokenBuckets, retry_after
from deployments.router import rate_limiter
from deployments.shared_limits import SharedTokenBuckets
from index_updater.clients import redis_client
from index_updater.local_redis import LocalRedis, free_port
from tests.integration.conftest import eventually


def routers(client, rate: float, burst: int, n: int = 2, **kwargs) -> list[SharedTokenBuckets]:
    """`n` routers' limiters on one fresh key prefix (each with its own fallback bucket)."""
    prefix = f"test:{uuid.uuid4().hex}:rate:"
    return [SharedTokenBuckets(client, prefix, TokenBuckets(rate, burst), **kwargs) for _ in range(n)]


def test_two_routers_share_one_limit_and_it_refills(redis_server):
    _, client = redis_server
    a, b = routers(client, rate=2.0, burst=3)
    assert [a.take("acme", 100.0), b.take("acme", 100.0), a.take("acme", 100.0)] == [0, 0, 0]
    assert b.take("acme", 100.0) == pytest.approx(0.5) and a.take("acme", 100.0) == pytest.approx(0.5)
    assert a.take("globex", 100.0) == 0  # another caller has its own bucket
    assert b.take("acme", 100.5) == 0 and a.take("acme", 100.5) == pytest.approx(0.5)  # one token per 1/rate s
    waits = [b.take("acme", 200.0), a.take("acme", 200.0), b.take("acme", 200.0), a.take("acme", 200.0)]
    assert waits == [0, 0, 0, pytest.approx(0.5)]  # idle for long: the burst is back, not more


def test_retry_after_comes_from_the_shared_bucket(redis_server):
    _, client = redis_server
    a, b = routers(client, rate=0.2, burst=1)
    assert a.take("acme", 10.0) == 0
    assert b.take("acme", 10.0) == pytest.approx(5.0) and retry_after(b.take("acme", 12.2)) == "3"


def test_without_a_clock_of_its_own_the_bucket_uses_redis_time(redis_server):
    _, client = redis_server
    a, b = routers(client, rate=0.001, burst=1)
    assert a.take("acme") == 0
    assert b.take("acme") == pytest.approx(1000, abs=1)


def test_an_idle_bucket_expires_once_it_would_be_full(redis_server):
    _, client = redis_server
    (a,) = routers(client, rate=1000.0, burst=2, n=1)
    a.take("acme")
    key = a.prefix + "acme"
    assert 0 < client.pttl(key) <= 1002  # burst / rate s, plus a second
    assert eventually(lambda: not client.exists(key), 5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.1, 50), st.integers(1, 5),
       st.lists(st.tuples(st.integers(0, 2), st.floats(0, 2)), min_size=1, max_size=25))
def test_the_shared_bucket_answers_as_one_in_process_bucket(redis_server, rate, burst, takes):
    """Any interleaving of three routers' takes gets the waits one TokenBuckets would give."""
    _, client = redis_server
    shared, reference, now = routers(client, rate, burst, n=3), TokenBuckets(rate, burst), 1000.0
    for router, dt in takes:
        now += dt
        assert shared[router].take("acme", now) == pytest.approx(reference.take("acme", now), abs=1e-6)


class Silent:
    """A listener that accepts connections and never answers (a hung or black-holed Redis)."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        return f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"

    def __exit__(self, *exc) -> None:
        self.sock.close()


@pytest.mark.parametrize("store", ["closed port", "no answer"])
def test_without_redis_each_router_falls_back_to_its_own_bucket(store, caplog):
    with Silent() as silent:
        url = silent if store == "no answer" else f"redis://127.0.0.1:{free_port()}/0"
        fallbacks = []
        (a,) = routers(redis_client(url, 0.05), rate=1.0, burst=2, n=1, retry_s=60,
                       on_fallback=lambda: fallbacks.append(1))
        with caplog.at_level(logging.WARNING, logger="deployments.shared_limits"):
            waits = [a.take("acme", 5.0) for _ in range(3)]
    assert waits == [0, 0, pytest.approx(1.0)] and len(fallbacks) == 3  # fail open, to the local limit
    assert len(caplog.records) == 1 and "Redis failed" in caplog.text  # one try per retry_s, one line


def test_the_shared_bucket_is_asked_again_once_redis_is_back(tmp_path):
    # A closed port refuses at once, so the timeout only bounds the calls once Redis is back: generous,
    # because a loaded CI box took longer than 50 ms for the first script load (CI failed on it).
    port, fallbacks = free_port(), []
    (a,) = routers(redis_client(f"redis://127.0.0.1:{port}/0", 5.0), rate=1.0, burst=1, n=1, retry_s=0,
                   on_fallback=lambda: fallbacks.append(1))
    assert a.take("acme", 5.0) == 0 and len(fallbacks) == 1
    server = LocalRedis(tmp_path / "redis", port=port, aof=False).start()
    try:
        assert a.take("acme", 5.0) == 0 and len(fallbacks) == 1  # Redis's bucket was full: the local one is not
        assert a.take("acme", 5.0) == pytest.approx(1.0)
    finally:
        server.stop()


def test_the_config_chooses_the_limiter():
    url = f"redis://127.0.0.1:{free_port()}/0"  # not connected to until a request is limited
    limit = RateLimit(requests_per_s=2, burst=3)
    assert rate_limiter(ServiceConfig(redis_url=url)) is None
    assert type(rate_limiter(ServiceConfig(redis_url=url, rate_limit=limit))) is TokenBuckets  # the default
    shared = rate_limiter(ServiceConfig(redis_url=url, stream="s", rate_limit=limit.model_copy(update={"shared": True})))
    assert isinstance(shared, SharedTokenBuckets) and shared.prefix == "s:rate:"
    assert (shared.rate, shared.burst) == (2, 3)


def test_the_documented_acl_user_may_keep_the_buckets(tmp_path):
    """docs/operations.md's ACL (the stream keys, +@all -@dangerous) covers `<stream>:rate:*` and EVALSHA."""
    server = LocalRedis(tmp_path / "redis", username="andromeda", password="pw", extra_args=[
        "--user", "default", "off", "--user", "andromeda", "on", ">pw", "~andromeda:*", "+@all", "-@dangerous"])
    server.start()
    try:
        limits = rate_limiter(ServiceConfig(redis_url=f"redis://andromeda:pw@127.0.0.1:{server.port}/0",
                                            rate_limit=RateLimit(requests_per_s=1, burst=1, shared=True,
                                                                 store_timeout_s=5)))  # not a timeout test: a slow
        # fsync must not make it fall back
        fallbacks = []
        limits.on_fallback = lambda: fallbacks.append(1)
        assert limits.take("acme", 1.0) == 0 and limits.take("acme", 1.0) == pytest.approx(1.0) and not fallbacks
    finally:
        server.stop()
