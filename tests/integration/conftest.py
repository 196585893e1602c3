from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import ray
import redis
from ray import serve
from ray.serve import Application

from andromeda_core.index import AdIndex
from deployments.config import SERVE_ENV
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis, free_port
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


@pytest.fixture
def private_redis(tmp_path) -> Iterator[LocalRedis]:
    """A redis-server of this test alone (never the session's or REDIS_URL's: tests stop it); whatever the test did to
    it, resumed and killed after."""
    server = LocalRedis(tmp_path / "private-redis", aof=False).start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.kill()


@contextmanager
def hung(server: LocalRedis) -> Iterator[None]:
    """The server stopped (SIGSTOP) for the block: connections are accepted, no command is answered."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@contextmanager
def redis_for(tmp: Path) -> Iterator[str]:
    """REDIS_URL's Redis, or a private redis-server in `tmp` (stopped after): yields its URL."""
    server = None if os.environ.get("REDIS_URL") else LocalRedis(tmp / "redis").start()
    try:
        yield os.environ.get("REDIS_URL") or server.url
    finally:
        if server is not None:
            server.stop()


WRITE_TOKEN = "integration-test-write-token"  # ANDROMEDA_WRITE_TOKEN of the session's Ray workers: an admin's


@contextmanager
def local_ray(workers_env: dict[str, str]) -> Iterator[None]:
    """A local Ray (2 CPUs) whose processes inherit `workers_env` (set in this process only while Ray starts) and the
    service's Ray Serve settings (SERVE_ENV, as `andromeda up` and the image set them; this process keeps them while
    Ray runs); after: Serve and Ray shut down, the environment restored."""
    env = {**SERVE_ENV, **workers_env}
    before = {key: os.environ.get(key) for key in env}

    def restore(keys) -> None:
        for key in keys:
            if before[key] is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before[key]

    os.environ.update(env)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except BaseException:
        restore(env)
        raise
    restore(workers_env)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        restore(SERVE_ENV)


@pytest.fixture(scope="session")
def session_redis_url(tmp_path_factory) -> Iterator[str]:
    """The URL of the Redis the services on Ray share: REDIS_URL's, or a redis-server started once per session."""
    with redis_for(tmp_path_factory.mktemp("session-redis")) as url:
        yield url


@pytest.fixture(scope="session")
def ray_serve(session_redis_url) -> Iterator[str]:
    """Ray Serve on a local Ray, started once per session (the tests that use it run last: tests/conftest.py): its
    base URL. Its workers read REDIS_URL (session_redis_url) and ANDROMEDA_WRITE_TOKEN (WRITE_TOKEN) from their
    environment, as the pods do from the Secret. Each module deletes the applications it deployed."""
    with local_ray({"REDIS_URL": session_redis_url, "ANDROMEDA_WRITE_TOKEN": WRITE_TOKEN}):
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"


@contextmanager
def deployed(apps: dict[str, Application]) -> Iterator[None]:
    """Each application of apps (name -> app) run on the session's Serve at route prefix /name; deleted after."""
    try:
        for name, app in apps.items():
            serve.run(app, name=name, route_prefix=f"/{name}")
        yield
    finally:  # every one, even after one that fails to go, so that none starves the next module's of the 2 CPUs
        failed = []
        for name in apps:
            try:
                serve.delete(name)
            except Exception as exc:
                failed.append(f"{name}: {exc!r}")
        assert not failed, failed


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """Whether `condition()` holds within `timeout_s`, polled every `poll_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()
