"""A replica consumer's health without Redis: when its stream counts as down, and that a stream down exempts only its
lag (tests/integration/test_consumer_health.py and test_update_path_down.py run it against a real redis-server)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from andromeda_core.index import AdIndex
from deployments.shard import ShardReplica
from index_updater.clients import redis_client
from index_updater.consumer import REPLY_TIMEOUT_S, ConsumerStats, ShardConsumer, consumer_client

NOWHERE = "redis://127.0.0.1:1/0"  # never connected to: a client connects at its first command


def test_the_stream_is_down_past_the_bound_only_with_a_failed_or_a_waiting_read():
    stats = ConsumerStats(read_at=100.0)  # the last read Redis answered, on the monotonic clock
    stats.read_error = "ConnectionError: refused"
    assert stats.stream_down(10, now=105) == ""  # within the bound
    assert stats.stream_down(10, now=112.34) == "stream unreachable for 12.3 s: ConnectionError: refused"
    stats.read_error = ""
    assert stats.stream_down(10, now=130) == ""  # a long turn between two reads: a slow apply, a start's warm-up
    stats.reading_since = 125.0
    assert stats.stream_down(10, now=130) == ""  # the read after it has waited 5 s
    assert stats.stream_down(10, now=136) == "stream unreachable for 36.0 s: a read has waited 11.0 s for Redis's reply"
    assert stats.read_age_s(now=136) == 36


def test_a_dead_consumer_thread_fails_the_health_check_while_its_stream_is_down(small_schema, scorer):
    """The stream down exempts the replica's lag, not a consumer that no longer runs: Serve must replace it."""
    consumer = ShardConsumer(consumer_client(NOWHERE), AdIndex(small_schema, scorer.dim, 2), scorer.name)
    consumer.stats.read_at = time.monotonic() - 60  # its thread died after its last read, a minute ago
    consumer.stats.read_error = consumer.stats.last_error = "ConnectionError: refused"
    assert consumer.stats.stream_down(10).startswith("stream unreachable for 6")
    assert not consumer.alive
    replica = SimpleNamespace(consumer=consumer, shard=3, config=SimpleNamespace(max_lag_s=30.0, stream_down_s=10.0))
    with pytest.raises(RuntimeError, match=r"^shard 3: consumer thread is not running; last error: ConnectionError"):
        ShardReplica.func_or_class.check_health(replica)


@pytest.mark.parametrize("wait_s, block_ms", [(REPLY_TIMEOUT_S, 10_000), (REPLY_TIMEOUT_S, 60_000), (0.05, 50)])
def test_a_read_may_not_block_as_long_as_the_client_waits_for_a_reply(small_schema, scorer, wait_s, block_ms):
    """Every idle read would end in a TimeoutError, and the stream would count as down."""
    with pytest.raises(ValueError, match=f"block_ms {block_ms} must be shorter than the client's reply timeout"):
        ShardConsumer(redis_client(NOWHERE, wait_s), AdIndex(small_schema, scorer.dim, 2), scorer.name,
                      block_ms=block_ms)
    assert ShardConsumer(redis_client(NOWHERE, wait_s), AdIndex(small_schema, scorer.dim, 2), scorer.name,
                         block_ms=int(wait_s * 1000) - 1).block_ms == int(wait_s * 1000) - 1
