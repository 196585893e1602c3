"""A private redis-server owns its data directory: a second one would append to the same AOF files."""
from __future__ import annotations

import errno

import pytest

from index_updater.local_redis import LocalRedis


def test_a_second_server_on_a_directory_in_use_is_refused_naming_it(tmp_path):
    first = LocalRedis(tmp_path / "redis").start()
    try:
        with pytest.raises(OSError) as refused:
            LocalRedis(tmp_path / "redis").start()
        assert refused.value.errno == errno.EBUSY and refused.value.filename == str(tmp_path / "redis")
        first.unlock()  # the server inherited the lock: it holds the directory while it runs, even orphaned
        with pytest.raises(OSError):
            LocalRedis(tmp_path / "redis").start()
    finally:
        first.kill()
    second = LocalRedis(tmp_path / "redis").start()  # free once the first is gone: its data is the second's now
    second.stop()
    LocalRedis(tmp_path / "redis").start().stop()


def test_a_server_that_fails_to_start_leaves_the_directory_free(tmp_path):
    broken = LocalRedis(tmp_path / "redis")
    broken.binary = str(tmp_path / "no-redis-server")
    with pytest.raises(FileNotFoundError):
        broken.start()
    assert broken.lock_fd is None
    LocalRedis(tmp_path / "redis").start().stop()
