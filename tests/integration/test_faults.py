"""Faults on the update path with a real redis-server and real consumers (no Ray): hostile stream entries,
a Redis crash while publishing and consuming, corrupted snapshots, Redis credentials kept out of messages,
and stream trimming that never removes what an index still needs. Each test is bounded in time and uses
loopback only. The figures they measure are in docs/reliability.md."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings, strategies as st

from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.types import parse_event
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis
from index_updater.publisher import DEFAULT_STREAM, Publisher
from index_updater.records import dead_letter_stream, encode, shard_stream
from index_updater.snapshots import SnapshotStore
from tests.conftest import upsert
from tests.integration.conftest import eventually

SHARD0 = shard_stream(DEFAULT_STREAM, 0)
FIGURES: dict[str, object] = {}  # printed at the end of the module (-s) for docs/reliability.md




def rebuilt_digest(client: redis.Redis, schema, scorer, stream: str = DEFAULT_STREAM) -> str:
    """The digest of an index built from nothing but what the stream holds now."""
    fresh = ShardConsumer(client, AdIndex(schema, scorer.dim, capacity=4), scorer.name, stream=stream, block_ms=10)
    fresh.catch_up()
    return fresh.index.digest()


# -- hostile stream entries --------------------------------------------------------------------------

def valid_fields(small_schema, scorer, ad_id: int) -> dict:
    op = prepare_ops(small_schema, scorer, [parse_event(upsert(ad_id, 1, {"country": {"any_of": ["US"]}}))])[0]
    return {key.encode(): (value if isinstance(value, bytes) else str(value).encode())
            for key, value in encode(op, 1, small_schema, scorer.name, scorer.dim).items()}


def mutated(base: dict):
    """A valid entry with one field replaced, cut, extended or removed."""
    key = st.sampled_from(sorted(base))
    return st.one_of(
        st.builds(lambda k, v: {**base, k: v}, key, st.binary(max_size=300)),
        st.builds(lambda k, n: {**base, k: base[k][:n]}, key, st.integers(0, 40)),
        st.builds(lambda k, extra: {**base, k: base[k] + extra}, key, st.binary(min_size=1, max_size=16)),
        st.builds(lambda k: {f: v for f, v in base.items() if f != k}, key).filter(bool),
        st.builds(lambda k, i, b: {**base, k: base[k][:i] + bytes([b]) + base[k][i + 1:]}, key, st.integers(0, 400),
                  st.integers(0, 255)),
    )


HOSTILE_EXAMPLES = 120


def test_hostile_entries_go_to_dead_letters_and_never_stop_the_consumer(redis_server, small_schema, scorer):
    """Any bytes in any fields, and valid entries with one field broken: the running consumer dead-letters
    what it cannot apply, applies the rest, and goes on to apply the next good event."""
    _, client = redis_server
    publisher = Publisher(client, small_schema, scorer)
    consumer = ShardConsumer(client, AdIndex(small_schema, scorer.dim, capacity=4), scorer.name, block_ms=10).start()
    base = valid_fields(small_schema, scorer, 5)
    entries = st.one_of(st.dictionaries(st.binary(min_size=1, max_size=24), st.binary(max_size=300), min_size=1,
                                        max_size=8), mutated(base))
    tried = {"entries": 0, "good": 0}

    @given(hostile=st.lists(entries, min_size=1, max_size=4))
    @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(hostile):
        for fields in hostile:
            client.xadd(SHARD0, fields)
        tried["entries"] += len(hostile)
        tried["good"] += 1
        good_id = 100_000 + tried["good"]
        last = publisher.publish([upsert(good_id, 1)])[0]
        assert eventually(lambda: consumer.stats.last_id == last, 10), consumer.stats
        assert consumer.alive and good_id in consumer.index.ad_ids()

    try:
        check()
    finally:
        consumer.stop()
    s = consumer.stats
    assert s.applied + s.stale + s.dead_letters == tried["entries"] + tried["good"]
    assert s.dead_letters >= tried["entries"] // 2 and client.xlen(dead_letter_stream(DEFAULT_STREAM)) == s.dead_letters
    assert consumer.index.digest() == rebuilt_digest(client, small_schema, scorer)  # what applied is what the stream says
    FIGURES["hostile entries tried"] = tried["entries"]
    FIGURES["hostile entries dead-lettered"] = s.dead_letters


# -- Redis crash while publishing and consuming -----------------------------------------------------

def test_redis_crash_under_load_loses_no_acknowledged_event_and_replicas_match_the_stream(tmp_path, small_schema, scorer):
    """Open-loop publishing at a fixed rate while two replicas consume; redis-server is killed (SIGKILL) and
    restarted on the same port and AOF twice. Every acknowledged event is in the stream, both replicas
    resume, and each one's index digest equals the one rebuilt from the stream."""
    server = LocalRedis(tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
    publisher = Publisher(client, small_schema, scorer, attempts=200)
    replicas = [ShardConsumer(redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2),
                              AdIndex(small_schema, scorer.dim, capacity=4), scorer.name, block_ms=10).start()
                for _ in range(2)]
    acknowledged: dict[int, str] = {}
    stop = threading.Event()

    def publish_open_loop(rate_per_s: float = 200.0):
        """One event every 1/rate s on a fixed schedule (a late send does not delay the next ones' schedule)."""
        started, n = time.monotonic(), 0
        while not stop.is_set() and n < 1500:
            n += 1
            time.sleep(max(0.0, started + n / rate_per_s - time.monotonic()))
            ad_id = n % 400 + 1  # updates of the same ads too: versions must order them
            acknowledged[n] = publisher.publish([upsert(ad_id, n)])[0]

    thread = threading.Thread(target=publish_open_loop)
    thread.start()
    try:
        for at in (300, 800):
            assert eventually(lambda: len(acknowledged) >= at, 30)
            server.kill()
            time.sleep(0.3)
            server.start()
        thread.join(timeout=120)
        assert not thread.is_alive() and len(acknowledged) == 1500
        ids = {entry_id.decode() for entry_id, _ in client.xrange(SHARD0)}
        lost = [n for n, entry_id in acknowledged.items() if entry_id not in ids]
        last = max(ids, key=lambda i: tuple(map(int, i.split("-"))))
        assert all(eventually(lambda r=r: r.stats.last_id == last, 30) for r in replicas)
        want = rebuilt_digest(client, small_schema, scorer)
        assert lost == [] and [r.index.digest() for r in replicas] == [want, want]
        assert all(r.alive for r in replicas) and sum(r.stats.errors for r in replicas) > 0  # they did see the crashes
        FIGURES["redis crashes survived"] = 2
        FIGURES["acknowledged events"] = len(acknowledged)
        FIGURES["acknowledged events lost"] = len(lost)
        FIGURES["replica digests equal to the rebuild"] = f"{len(replicas)}/{len(replicas)}"
    finally:
        stop.set()
        for r in replicas:
            r.stop()
        server.stop()


# -- a slow consumer --------------------------------------------------------------------------------

def test_a_slow_consumer_reports_lag_fails_health_and_holds_one_read_at_a_time(setup, monkeypatch):
    """Publishing outruns a consumer whose applies are slowed: its lag passes max_lag_s (the health check and
    so readiness fail, with the reason; the lag gauge crosses the alert's threshold), it never holds more
    than one read (`count` entries: no batch is longer) in memory, and once the burst is over it catches up and is
    healthy."""
    client, publisher, make = setup
    consumer = make(count=50)
    real_apply, read_sizes = consumer.index.apply, []
    real_read = consumer._apply_read

    def slow_apply(batch):
        time.sleep(0.05)
        return real_apply(batch)

    def counted_read(entries):
        read_sizes.append(len(entries))
        return real_read(entries)

    monkeypatch.setattr(consumer.index, "apply", slow_apply)
    monkeypatch.setattr(consumer, "_apply_read", counted_read)
    consumer.start()
    max_lag_s, peak, unhealthy = 1.0, 0.0, []
    try:
        for b in range(40):
            publisher.publish([upsert(b * 50 + i + 1) for i in range(50)])
        while not consumer.caught_up or consumer.stats.last_id != client.xinfo_stream(SHARD0)["last-generated-id"].decode():
            peak = max(peak, consumer.stats.lag_seconds())
            healthy, reason = consumer.health(max_lag_s)
            if not healthy:
                unhealthy.append(reason)
            time.sleep(0.05)
            assert consumer.alive
        assert unhealthy and "unapplied entries have waited" in unhealthy[-1] and peak > max_lag_s
        assert max(read_sizes) <= 50 and len(consumer.index) == 2000
        assert eventually(lambda: consumer.health(max_lag_s) == (True, "ok"), 20)
    finally:
        consumer.stop()
    FIGURES["slow consumer: peak lag s"] = round(peak, 2)
    FIGURES["slow consumer: largest read held"] = max(read_sizes)


# -- corrupted snapshots ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_newest_snapshot_is_skipped_for_an_older_one_plus_replay(setup, tmp_path, scorer, damage):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots", keep=3)
    leader = make(snapshots=store)
    publisher.publish([upsert(i) for i in range(1, 21)])
    leader.catch_up()
    leader.snapshot()
    older = leader.stats.last_id
    publisher.publish([upsert(i, 2) for i in range(10, 31)])
    leader.catch_up()
    newest = leader.snapshot() or store.paths()[0]
    data = newest.read_bytes()
    newest.write_bytes({"truncate": data[: len(data) // 2], "flip": data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:],
                        "empty": b""}[damage])
    follower = make(snapshots=store)
    assert follower.recover() and follower.stats.last_id == older  # the older snapshot
    follower.catch_up()  # plus replay
    assert follower.index.digest() == leader.index.digest() == rebuilt_digest(client, follower.schema, scorer)


# -- trimming ---------------------------------------------------------------------------------------

def test_trimming_never_removes_what_a_live_replica_or_the_oldest_snapshot_needs(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots", keep=2)
    leader = make(snapshots=store, trim=True, replica_id="leader", trim_keep_entries=5)
    lagging = make(snapshots=store, replica_id="lagging")
    publisher.publish([upsert(i) for i in range(1, 11)])
    lagging.catch_up()  # reports 10 applied entries
    held = lagging.stats.last_id
    publisher.publish([upsert(i) for i in range(11, 41)])
    leader.catch_up()
    leader.snapshot()  # covers all 40; the lagging replica holds trimming at its 10th entry
    assert client.xrange(SHARD0)[0][0].decode() == held
    lagging.catch_up()  # no gap: nothing it needed was trimmed
    assert lagging.index.digest() == leader.index.digest()
    leader.snapshot()
    assert client.xlen(SHARD0) == 5  # now only the keep_entries floor holds
    client.hset(leader.applied_key, "lagging", f"{held} {time.time() - 3600:.3f}")  # a replica gone for an hour
    publisher.publish([upsert(i) for i in range(41, 51)])
    leader.catch_up()
    assert leader.trim_stream() == 4  # entries 36-39: the oldest snapshot (entry 40) now bounds it, not "lagging"
    assert client.xrange(SHARD0)[0][0].decode() == store.oldest_stream_id()
    assert client.hkeys(leader.applied_key) == [b"leader"]  # the stale report was dropped


def test_trimming_waits_for_a_snapshot(setup, tmp_path):
    client, publisher, make = setup
    leader = make(snapshots=SnapshotStore(tmp_path / "none"), trim=True, replica_id="leader")
    publisher.publish([upsert(i) for i in range(1, 6)])
    leader.catch_up()
    assert leader.trim_stream() == 0 and client.xlen(SHARD0) == 5


# -- Redis credentials ------------------------------------------------------------------------------

PASSWORD = "n0t-4-l0g-8c1e"


def test_redis_auth_acl_user_and_no_password_in_any_message(tmp_path, small_schema, scorer):
    """requirepass plus an ACL user limited to the stream keys: publisher and consumer work with the user's
    URL; a wrong password fails with messages (consumer state, CLI error) that never show it."""
    server = LocalRedis(tmp_path / "redis", username="andromeda", password=PASSWORD, extra_args=[
        "--user", "default", "off",
        "--user", "andromeda", "on", f">{PASSWORD}", f"~{DEFAULT_STREAM}:*", "+@all", "-@dangerous", "+info"]).start()
    try:
        host = f"127.0.0.1:{server.port}"
        url = f"redis://andromeda:{PASSWORD}@{host}/0"
        publisher = Publisher(redis.Redis.from_url(url), small_schema, scorer)
        consumer = ShardConsumer(redis.Redis.from_url(url), AdIndex(small_schema, scorer.dim, capacity=4), scorer.name)
        publisher.publish([upsert(1), upsert(2)])
        consumer.catch_up()
        assert sorted(consumer.index.ad_ids()) == [1, 2]
        with pytest.raises(redis.ResponseError):
            redis.Redis.from_url(url).set("other:key", 1)  # the ACL keeps the user to its streams

        wrong = f"redis://andromeda:{PASSWORD}-wrong@{host}/0"
        bad = ShardConsumer(redis.Redis.from_url(wrong), AdIndex(small_schema, scorer.dim, capacity=4), scorer.name,
                            block_ms=10).start()
        assert eventually(lambda: bad.stats.errors > 0, 20)
        bad.stop()
        assert "Authentication" in bad.stats.last_error or "WRONGPASS" in bad.stats.last_error
        assert PASSWORD not in bad.stats.last_error and PASSWORD not in bad.health(30)[1]
        events = tmp_path / "events.jsonl"
        events.write_text('{"op": "delete", "ad_id": 1, "version": 9}\n')
        for target in (wrong, f"redis://andromeda:{PASSWORD}@127.0.0.1:1/0"):  # refused, then unreachable
            done = subprocess.run([str(Path(sys.executable).with_name("andromeda")), "publish", str(events), "--redis", target,
                                   "--tries", "1"], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and "redis://***@" in done.stderr, done.stderr
            assert PASSWORD not in done.stdout + done.stderr
    finally:
        server.stop()


def test_figures(request):
    """Prints what this module measured (run with -s) for docs/reliability.md."""
    print("\nreliability figures:", FIGURES)
