"""The background consumer never dies on an error, and reports its health: thread alive, caught up,
lag of unapplied entries, and a stream gap that no snapshot covers (real redis-server)."""
from __future__ import annotations

import threading
import time

import redis

from andromeda_core.ingest import prepare_ops
from andromeda_core.types import parse_event
from index_updater.publisher import DEFAULT_STREAM
from index_updater.records import encode, shard_stream
from index_updater.snapshots import SnapshotStore, stream_id_key
from tests.conftest import upsert, wait_until

SHARD0 = shard_stream(DEFAULT_STREAM, 0)


def once(error: Exception, call):
    """`call`, except that its first invocation raises `error`."""
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return call(*args, **kwargs)

    return flaky


def test_a_redis_error_is_counted_and_the_consumer_carries_on(setup, monkeypatch):
    client, publisher, make = setup
    c = make()
    monkeypatch.setattr(c.client, "xread", once(redis.ResponseError("WRONGTYPE injected"), c.client.xread))
    publisher.publish([upsert(1)])
    c.start()
    try:
        assert wait_until(lambda: 1 in c.index)
        assert c.alive and c.stats.errors == 1 and c.stats.last_error == "ResponseError: WRONGTYPE injected"
    finally:
        c.stop()


def test_a_failed_snapshot_is_counted_and_the_consumer_carries_on(setup, tmp_path, monkeypatch):
    _, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    monkeypatch.setattr(store, "write_state", once(OSError(28, "No space left on device"), store.write_state))
    c = make(snapshots=store, snapshot_every_s=0)
    publisher.publish([upsert(1)])
    c.start()
    try:
        assert wait_until(lambda: store.paths() and 1 in c.index)  # a later snapshot was written
        assert c.alive and c.stats.errors == 1 and "OSError: [Errno 28] No space left" in c.stats.last_error
        publisher.publish([upsert(2)])
        assert wait_until(lambda: 2 in c.index)
    finally:
        c.stop()


def test_health_follows_the_thread_and_the_lag_of_unapplied_entries(setup, small_schema, scorer, monkeypatch):
    client, _, make = setup
    c = make()
    assert c.health(60) == (False, "consumer thread is not running") and not c.caught_up
    (op,) = prepare_ops(small_schema, scorer, [parse_event(upsert(1))])
    client.xadd(SHARD0, encode(op, 1, small_schema, scorer.name, scorer.dim, now_ms=1_000))  # published in 1970
    applying, release = threading.Event(), threading.Event()
    real_apply = c.index.apply

    def slow_apply(batch):
        applying.set()
        release.wait(10)
        return real_apply(batch)

    monkeypatch.setattr(c.index, "apply", slow_apply)
    c.start()
    try:
        assert applying.wait(10)  # read, not yet applied
        healthy, reason = c.health(60)
        assert not healthy and "unapplied entries have waited" in reason and not c.caught_up
        release.set()
        assert wait_until(lambda: c.caught_up)
        assert c.health(60) == (True, "ok") and 1 in c.index
        assert c.stats.lag_seconds(now=time.time() + 3600) == 0  # an idle stream adds no lag
        assert c.stats.newest_published_ms == 1_000 and c.stats.applied_at > 0
    finally:
        release.set()
        c.stop()
    assert not c.alive and not c.health(60)[0]


def test_a_dead_thread_is_unhealthy(setup, monkeypatch):
    _, _, make = setup
    c = make()

    def exit_thread(*args, **kwargs):
        raise SystemExit  # not an Exception: the loop does not catch it and the thread ends

    monkeypatch.setattr(c, "poll", exit_thread)
    c.start()
    assert wait_until(lambda: not c.alive)
    assert c.health(60) == (False, "consumer thread is not running")


def test_caught_up_once_a_read_is_not_full(setup):
    _, publisher, make = setup
    c = make(count=2)
    for i in range(1, 6):  # batches of one: a read ends after any entry
        publisher.publish([upsert(i)])
    assert [c.poll(block_ms=0) for _ in range(2)] == [2, 2] and not c.caught_up
    assert c.stats.lag_seconds() > 0  # entries are known to wait
    assert c.poll(block_ms=0) == 1 and c.caught_up and c.stats.lag_seconds() == 0
    for i in range(6, 9):
        publisher.publish([upsert(i)])
    assert c.poll(block_ms=0) == 2 and c.caught_up  # stays True


def test_an_uncovered_gap_is_reported_until_a_snapshot_covers_it(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots", keep=1)
    leader = make(snapshots=store, trim=True)
    publisher.publish([upsert(i) for i in range(1, 11)])
    leader.catch_up()
    ids = [entry_id for entry_id, _ in client.xrange(SHARD0)]
    client.xtrim(SHARD0, minid=ids[5], approximate=False)  # ads 1-5 trimmed away, no snapshot covers them
    lagging = make(snapshots=store).start()
    try:
        assert wait_until(lambda: lagging.stats.gap_unrecovered and len(lagging.index) == 5)
        assert sorted(lagging.index.ad_ids()) == [6, 7, 8, 9, 10]  # what the stream still held is applied
        healthy, reason = lagging.health(60)
        assert not healthy and "no snapshot covers" in reason and "trimmed" in reason
        lagging.snapshot()
        assert store.paths() == []  # an index that misses updates is not passed on as a snapshot
        leader.snapshot()  # a complete replica's snapshot covers the gap
        assert wait_until(lambda: not lagging.stats.gap_unrecovered)
        assert lagging.index.digest() == leader.index.digest() and lagging.health(60) == (True, "ok")
    finally:
        lagging.stop()



def test_an_idle_streams_watermark_moves_on_with_redis_clock(setup):
    """A request's index_watermark is its shards' oldest: a shard whose stream saw nothing since id X reported X for
    ever, so a write to another shard (a newer id) never showed as applied by every shard. Once a read finds nothing
    past what it applied, the watermark is Redis's clock at that read (less 1 ms); a full read claims nothing more."""
    client, publisher, make = setup
    c = make(count=2)
    assert c.stats.watermark() is None
    ids = [publisher.publish([upsert(i)])[0] for i in range(1, 6)]  # batches of one: a read ends after any entry
    assert c.poll(block_ms=0) == 2 and c.stats.caught_up_to == "" and c.stats.watermark() == ids[1]  # more may wait
    c.poll(block_ms=0)
    c.poll(block_ms=0)
    caught = c.stats.watermark()
    assert c.stats.last_id == ids[-1] and stream_id_key(caught) >= stream_id_key(ids[-1]) and caught == c.stats.caught_up_to
    time.sleep(0.01)
    assert c.poll(block_ms=0) == 0 and stream_id_key(c.stats.watermark()) > stream_id_key(caught)  # idle: it moves on
    later = publisher.publish([upsert(9)])[0]
    assert stream_id_key(c.stats.watermark()) < stream_id_key(later)  # not applied, not claimed
    seconds, micros = client.time()
    assert c.poll(block_ms=0) == 1 and stream_id_key(later) <= stream_id_key(c.stats.watermark()) < (seconds * 1000 + micros // 1000 + 1000, 0)


def test_a_stream_never_written_is_caught_up_to_redis_clock(setup):
    """A shard whose stream holds no entry yet (a small corpus puts ids 1-100 on one shard) had no watermark, which
    made every request's index_watermark null; a stream that does not exist holds nothing unapplied."""
    client, publisher, make = setup
    c = make(shard=1, shards=2)
    assert not client.exists(c.source)
    seconds, micros = client.time()
    assert c.poll(block_ms=0) == 0
    assert stream_id_key(c.stats.watermark()) >= (seconds * 1000 + micros // 1000 - 1, 0)
