"""Index updates through a real redis-server: publisher -> one stream per shard -> per-replica consumers."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
import torch

from andromeda_core.errors import InvalidInput
from andromeda_core.export import TableCopy
from andromeda_core.index import AdIndex
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.ops import PreparedAd
from andromeda_core.ingest import prepare_ops
from andromeda_core.sharding import shard_of
from andromeda_core.snapshot import load_snapshot
from andromeda_core.targeting import CompiledTargeting, compile_user
from andromeda_core.types import parse_event
from index_updater.consumer import LAYOUT_TTL_S, ShardConsumer, StreamGap
from index_updater.publisher import DEFAULT_STREAM, Publisher
from index_updater import consumer as consumer_module
from index_updater.records import GOES_ON, encode, layout_key, schema_tag, shard_stream
from index_updater import snapshots as snapshots_module
from index_updater.snapshots import SnapshotStore, stream_id_key
from tests.conftest import upsert, wait_until

NOW = 1_000_000
SHARD0 = shard_stream(DEFAULT_STREAM, 0)


def eligible(index: AdIndex, attributes: dict | None = None, now: int = NOW) -> list[int]:
    user = compile_user(index.schema, attributes or {}, {})[0]
    return index.eligible([user], [now])[0]


def test_create_edit_pause_resume_delete(setup):
    client, publisher, make = setup
    c = make()
    publisher.publish([upsert(1, 1, {"country": {"any_of": ["US"]}})])
    c.catch_up()
    assert eligible(c.index, {"country": "US"}) == [1]
    publisher.publish([upsert(1, 2, {"country": {"any_of": ["CA"]}})])
    c.catch_up()
    assert eligible(c.index, {"country": "US"}) == [] and eligible(c.index, {"country": "CA"}) == [1]
    publisher.publish([{"op": "pause", "ad_id": 1, "version": 3}])
    c.catch_up()
    assert eligible(c.index, {"country": "CA"}) == []
    publisher.publish([{"op": "resume", "ad_id": 1, "version": 4}])
    c.catch_up()
    assert eligible(c.index, {"country": "CA"}) == [1]
    publisher.publish([{"op": "delete", "ad_id": 1, "version": 5}])
    c.catch_up()
    assert 1 not in c.index and c.stats.applied == 5 and c.stats.last_id != "0-0"


def test_expiry_needs_no_event(setup):
    _, publisher, make = setup
    c = make()
    end = int(time.time()) + 2
    publisher.publish([upsert(1, end_time=end), upsert(2)])
    c.catch_up()
    assert eligible(c.index, now=end - 1) == [1, 2] and eligible(c.index, now=end) == [2]
    assert c.index.sweep_expired(end) == 1 and 1 not in c.index


def test_the_loop_sweeps_only_ads_that_ended_its_grace_before_its_clock(setup):
    """A request may ask as of an earlier time (context.ts): an ad that ended since is still matched then, on every
    replica, however soon each sweeps."""
    _, publisher, make = setup
    c = make(sweep_grace_s=600)
    now = int(time.time())
    publisher.publish([upsert(1, end_time=now - 60), upsert(2, end_time=now - 700), upsert(3)])
    c.catch_up()
    c._turn({"sweep": 0.0, "snapshot": float("inf"), "report": float("inf"), "trim": float("inf")})
    assert sorted(c.index.ad_ids()) == [1, 3] and eligible(c.index, now=now - 61) == [1, 3]
    assert eligible(c.index, now=now) == [3]


def test_the_sweep_goes_by_redis_clock_not_the_replicas(setup, monkeypatch):
    """A replica whose clock ran an hour fast freed ads still live, and its snapshots spread the loss to every
    replica that loaded one (replaying the upsert is a no-op at its version)."""
    _, publisher, make = setup
    c = make(sweep_grace_s=600)
    now = int(time.time())
    publisher.publish([upsert(1, end_time=now + 1800), upsert(2, end_time=now - 700)])
    c.catch_up()
    fast = time.time() + 7200
    monkeypatch.setattr(time, "time", lambda: fast)  # this replica's clock two hours ahead
    c._turn({"sweep": 0.0, "snapshot": float("inf"), "report": float("inf"), "trim": float("inf")})
    assert sorted(c.index.ad_ids()) == [1]


def test_a_stream_read_again_after_it_went_back_is_not_lag(setup, monkeypatch):
    """After a failover that lost the newest entry every replica reads its stream again from the start: the entries
    it had applied, read again, set the lag from their publish times, and every replica turned unhealthy at once
    (Serve replaced them all). Entries past the last one applied before still count, also in a read that holds
    both."""
    client, publisher, make = setup
    for i in range(1, 11):  # batches of one: a read ends after any entry
        publisher.publish([upsert(i)])
    c = make(count=3)
    c.catch_up()
    time.sleep(1.0)
    entries = client.xrange(SHARD0)
    client.delete(SHARD0)  # a failover that lost the newest entry
    for entry_id, fields in entries[:-2]:
        client.xadd(SHARD0, fields, id=entry_id)
    client.xadd(SHARD0, entries[-2][1] | {b"published_ms": str(int(time.time() * 1000)).encode()})  # one new
    # entry, published now, past the last applied before: read with the last old ones
    lags, apply = [], c._apply
    monkeypatch.setattr(c, "_apply", lambda read: (lags.append(c.stats.lag_seconds()), apply(read))[1])
    reads = [c.poll(block_ms=0)]
    assert c.stats.stream_resets == 1 and reads == [3] and c.stats.lag_seconds() == 0  # read again, full: no lag
    while reads[-1] == 3:
        reads.append(c.poll(block_ms=0))
    assert reads == [3, 3, 3, 0] and max(lags) < 0.8, lags  # the third read holds old entries and the new one
    assert sorted(c.index.ad_ids()) == list(range(1, 11)) and c.stats.lag_seconds() == 0  # lost ad 10 stays applied
    for i in range(11, 15):
        publisher.publish([upsert(i)])
    c.poll(block_ms=0)  # new entries, a full read: more wait
    assert c.stats.lag_seconds() > 0


def test_duplicate_and_out_of_order_delivery_is_idempotent(setup):
    _, publisher, make = setup
    events = [upsert(1, 3, {"age": {"min": 18}}), upsert(2, 1), {"op": "pause", "ad_id": 2, "version": 2}]
    reference = make()
    publisher.publish(events)
    reference.catch_up()
    publisher.publish(events)  # delivered twice
    publisher.publish([upsert(1, 2, {"age": {"min": 20}}), {"op": "resume", "ad_id": 2, "version": 1}])  # older
    c = make()
    c.catch_up()
    assert c.index.digest() == reference.index.digest()
    assert c.stats.applied == 3 and c.stats.stale == 5 and eligible(c.index, {"age": 19}) == [1]


def test_poison_entry_goes_to_dead_letters_and_the_next_good_one_applies(setup):
    client, publisher, make = setup
    c = make()
    publisher.publish([upsert(1)])
    tag = schema_tag(publisher.schema)
    client.xadd(SHARD0, {"op": "upsert", "shard": 0, "published_ms": 1, "schema": tag,
                         "model": "hashed_two_tower", "dim": 16, "event": '{"op": "upsert", "ad": {"ad_id": "bad"}}'})
    client.xadd(SHARD0, {"shard": 0, "published_ms": 1, "schema": "other:9", "dim": 16, "event": "{}"})
    client.xadd(SHARD0, {"garbage": b"\xff\xfe"})
    client.xadd(SHARD0, {"shard": 0, "published_ms": 1, "schema": tag, "model": "moe-v9", "dim": 16,
                         "event": "{}"})
    # the same name and version with other vocabularies (an edit without a new version): its value ids mean others
    client.xadd(SHARD0, {"shard": 0, "published_ms": 1, "schema": tag.rsplit(":", 1)[0] + ":" + "0" * 16,
                         "model": "hashed_two_tower", "dim": 16, "event": "{}"})
    publisher.publish([upsert(2)])
    c.catch_up()
    assert sorted([1, 2]) == eligible(c.index)
    dead = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert c.stats.dead_letters == len(dead) == 5
    reasons = [fields[b"field"].decode() + ": " + fields[b"reason"].decode() for _, fields in dead]
    assert "event.ad.ad_id" in reasons[0] and "schema" in reasons[1] and "shard" in reasons[2]
    assert reasons[3].startswith("model: embedded by model moe-v9")
    assert reasons[4].startswith(f"schema: written for schema small-test:1:{'0' * 16}, this index uses {tag}")
    other = make()  # another replica of the shard meets the same entries: it counts them, and adds none
    other.catch_up()
    assert other.stats.dead_letters == 5 and client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 5
    client.set(f"{DEFAULT_STREAM}:dead-letters:{SHARD0}:once", "not a sorted set")  # the shard's record, mangled
    client.xadd(SHARD0, {"garbage": b"\xff"})
    c.catch_up()
    assert c.stats.dead_letters == 6 and client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 6
    c.stats.last_id, c._from_start = "0-0", True  # the stream read again from its start, as after it went back
    c.catch_up()
    assert c.stats.dead_letters == 6  # the metric (and its alert) count no poison entry twice
    client.set(f"{DEFAULT_STREAM}:dead-letters", "not a stream")  # the dead-letter stream itself, mangled
    client.xadd(SHARD0, {"garbage": b"\xfd"})
    c.catch_up()  # its record is added (not marked done without one, then never retried)
    assert c.stats.dead_letters == 7 and client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 1


def test_bad_event_is_rejected_at_publish_and_writes_nothing(setup):
    client, publisher, _ = setup
    with pytest.raises(InvalidInput) as err:
        publisher.publish([upsert(1), upsert(2, targeting={"country": {"any_of": ["Atlantis"]}})])
    assert err.value.field == "ad.targeting.country.any_of[0]" and "ad 2" in err.value.message
    assert client.dbsize() == 0


def test_each_shard_has_its_stream_and_two_replicas_agree(setup):
    client, publisher, make = setup
    publisher.shards = 3
    publisher.publish([upsert(i, targeting={"age": {"min": 13 + i % 5}}) for i in range(1, 61)])
    publisher.publish([{"op": "pause", "ad_id": i, "version": 2} for i in range(1, 61, 7)])
    for shard in range(3):
        assert {shard_of(int(f[b"ad_id"]), 3) for _, f in client.xrange(shard_stream(DEFAULT_STREAM, shard))} == {shard}
    assert sum(client.xlen(shard_stream(DEFAULT_STREAM, shard)) for shard in range(3)) == 60 + 9
    replicas = [[make(shard, 3) for _ in range(2)] for shard in range(3)]
    for pair in replicas:
        for c in pair:
            c.catch_up()
    for shard, (a, b) in enumerate(replicas):
        assert a.index.digest() == b.index.digest()
        assert all(shard_of(ad_id, 3) == shard for ad_id in a.index.ad_ids())
    assert sum(len(pair[0].index) for pair in replicas) == 60


def test_killed_consumer_restarts_from_snapshot_plus_replay(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots", keep=2)
    first = make(snapshots=store, count=7)
    for i in range(1, 30):  # batches of one: a read ends after any entry
        publisher.publish([upsert(i)])
    first.poll(block_ms=0)
    first.poll(block_ms=0)
    first.snapshot()
    first.poll(block_ms=0)  # applied past the snapshot, then "killed"
    publisher.publish([{"op": "delete", "ad_id": i, "version": 2} for i in range(1, 10)] + [upsert(99)])
    restarted = make(snapshots=store)
    assert restarted.recover() and len(restarted.index) == 14
    restarted.catch_up()
    everything = make()
    everything.catch_up()
    assert restarted.index.digest() == everything.index.digest() and len(everything.index) == 21


def test_trim_keeps_what_the_oldest_snapshot_needs_and_gaps_reload(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots", keep=1)
    leader = make(snapshots=store, trim=True)
    publisher.publish([upsert(i) for i in range(1, 11)])
    lagging = make(snapshots=store)
    leader.catch_up()
    leader.snapshot()
    assert client.xlen(SHARD0) <= 1  # trimmed behind the snapshot
    publisher.publish([upsert(11)])
    leader.catch_up()
    with pytest.raises(StreamGap, match="trimmed"):
        lagging.catch_up()
    assert lagging.recover()
    lagging.catch_up()
    assert lagging.index.digest() == leader.index.digest()


def test_background_consumer_applies_what_is_published(setup):
    _, publisher, make = setup
    c = make().start()
    try:
        publisher.publish([upsert(5)])
        deadline = time.monotonic() + 10  # a bound against hanging, not a latency claim (see benchmarks.freshness)
        while 5 not in c.index and time.monotonic() < deadline:
            time.sleep(0.005)
        assert 5 in c.index and c.stats.applied == 1
    finally:
        c.stop()


def test_redis_restart_under_publishing_loses_no_acknowledged_event(redis_server, small_schema, scorer):
    server, client = redis_server
    if server is None:
        pytest.skip("needs a redis-server this test can kill (REDIS_URL is set)")
    publisher = Publisher(redis.Redis.from_url(server.url, socket_timeout=2), small_schema, scorer)
    acknowledged: list[int] = []

    def publish_forever():
        for ad_id in range(1, 301):
            publisher.publish([upsert(ad_id)])
            acknowledged.append(ad_id)

    thread = threading.Thread(target=publish_forever)
    thread.start()
    while len(acknowledged) < 50:
        time.sleep(0.01)
    server.kill()  # a crash mid-publishing
    time.sleep(0.3)
    server.start()
    thread.join(timeout=120)
    assert len(acknowledged) == 300
    c = ShardConsumer(redis.Redis.from_url(server.url), AdIndex(small_schema, scorer.dim), scorer.name, block_ms=10)
    c.catch_up()
    assert set(acknowledged) <= set(c.index.ad_ids())


def test_publish_cli_appends_a_file(redis_server, tmp_path):
    import json
    import os
    import subprocess
    import sys

    server, client = redis_server
    url = server.url if server else os.environ["REDIS_URL"]
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(json.dumps(upsert(i)) for i in range(1, 6)) + "\n")
    result = subprocess.run([sys.executable, "-m", "andromeda_cli", "publish", str(events), "--redis", url, "--shards", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    streams = [shard_stream(DEFAULT_STREAM, shard) for shard in range(2)]
    assert [client.xlen(s) for s in streams] == [sum(shard_of(i, 2) == s for i in range(1, 6)) for s in range(2)]
    assert "published 5 events" in result.stdout
    events.write_text(json.dumps(upsert(9, targeting={"planet": {"any_of": ["mars"]}})) + "\n")
    bad = subprocess.run([sys.executable, "-m", "andromeda_cli", "publish", str(events), "--redis", url],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "ad.targeting.planet" in bad.stderr and sum(map(client.xlen, streams)) == 5


def test_a_file_written_to_while_it_is_published_goes_out_as_it_was_checked(setup, tmp_path, monkeypatch):
    """Both passes read the bytes there when it was opened: a bad line appended after the check is not published
    (until 2026-12-07 the second pass read it, unchecked, and failed after publishing the batches before it)."""
    import json

    from index_updater import publisher as publisher_module

    client, publisher, _ = setup
    events = tmp_path / "growing.jsonl"
    events.write_text("".join(json.dumps(upsert(i)) + "\n" for i in range(1, 6)))
    check = publisher_module.compile_upserts

    def check_then_append(*args):  # a writer appends while the check runs
        with events.open("a") as f:
            f.write(json.dumps(upsert(6, targeting={"planet": {"any_of": ["mars"]}})) + "\n")
        return check(*args)
    monkeypatch.setattr(publisher_module, "compile_upserts", check_then_append)
    assert publisher.publish_file(events, batch_size=2) == 5 and client.xlen(SHARD0) == 5


def test_publishing_for_another_layout_than_the_replicas_read_is_refused(setup, redis_server, small_schema, scorer,
                                                                           tmp_path):
    """A consumer records the layout it applies (shards, schema, model, dims); a publisher for another is told so
    before it appends anything (its entries would go to a stream no replica reads, or to the dead letters)."""
    import json
    import os
    import subprocess
    import sys

    client, publisher, make = setup
    assert publisher.layout_mismatch() == {}  # no replica yet: nothing to check against
    consumer = make().start()
    try:
        deadline = time.monotonic() + 10
        while not client.exists(layout_key(DEFAULT_STREAM)) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        consumer.stop()
    assert publisher.layout_mismatch() == {}
    assert Publisher(client, small_schema, scorer, shards=2).layout_mismatch() == {"shards": ("1", "2")}
    assert 0 < client.ttl(layout_key(DEFAULT_STREAM)) <= LAYOUT_TTL_S  # a stopped service binds no one for long
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps(upsert(1)) + "\n")
    url = redis_server[0].url if redis_server[0] else os.environ["REDIS_URL"]
    refused = subprocess.run([sys.executable, "-m", "andromeda_cli", "publish", str(events), "--shards", "2", "--redis", url],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--shards" in refused.stderr and "Nothing was published" in refused.stderr
    assert [client.xlen(shard_stream(DEFAULT_STREAM, s)) for s in range(2)] == [0, 0]


def test_an_entry_the_index_rejects_is_dead_lettered_and_the_rest_of_its_batch_applies(setup, small_schema, scorer):
    client, publisher, make = setup
    (op,) = prepare_ops(small_schema, scorer, [parse_event(upsert(666, targeting={"city": {"any_of": ["c1"]}}))])
    rows = {**op.targeting.rows, "city.pos": np.full_like(op.targeting.rows["city.pos"], 300)}  # past the vocabulary
    publisher.publish([upsert(1)])
    client.xadd(SHARD0, encode(PreparedAd(op.ad, CompiledTargeting(rows, True), op.embedding), 1, small_schema,
                               scorer.name, scorer.dim))
    publisher.publish([upsert(2), {"op": "delete", "ad_id": 1, "version": 2}, upsert(1, 3)])
    client.xadd(SHARD0, {"garbage": b"\xff"})  # fails to decode, after the rejected one in the same read
    c = make()
    batches = applied_batches(c.index)
    c.catch_up()  # one read: the index rejects the batch, then takes every entry but ad 666's
    assert eligible(c.index) == [1, 2] and c.index.version_of(1) == 3 and 666 not in c.index
    assert batches == [5, 4]  # the rest as one batch: no scan sees part of it (until 2026-12-07 one by one)
    assert c.stats.dead_letters == 2 and c.stats.applied == 4
    rejected, garbage = client.xrange(f"{DEFAULT_STREAM}:dead-letters")  # in stream order, both
    assert b"index rejected it" in rejected[1][b"reason"] and b"city.pos" in rejected[1][b"reason"]
    assert garbage[1][b"field"] == b"shard"


def applied_batches(index: AdIndex) -> list[int]:
    """The sizes of the batches index.apply is called with from now on, in order (filled as it is called)."""
    sizes, apply = [], index.apply
    index.apply = lambda batch: sizes.append(len(batch)) or apply(batch)
    return sizes


def test_an_entry_the_index_fails_on_without_refusing_its_row_is_dead_lettered_alone(setup, monkeypatch):
    """The last resort: a fault no row check foresees (here injected: the writer fails on ad 7's row as it stages
    it) fails the batch with no row refused; the entries are then applied one by one, and only ad 7's is set aside."""
    client, publisher, make = setup
    publisher.publish([upsert(5), upsert(7), upsert(9)])
    c = make()
    stage = c.index._writer.stage

    def failing_on_ad_7(rows):
        if 7 in rows["ad_id"]:
            raise RuntimeError("injected fault")
        return stage(rows)

    monkeypatch.setattr(c.index._writer, "stage", failing_on_ad_7)
    batches = applied_batches(c.index)
    c.catch_up()
    assert eligible(c.index) == [5, 9] and batches == [3, 1, 1, 1]
    assert c.stats.dead_letters == 1 and c.stats.applied == 2
    ((_, record),) = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert b"index rejected it: RuntimeError: injected fault" in record[b"reason"]


@pytest.mark.parametrize("word", [2**31 - 1, -5, 1 << 5])
def test_a_forged_bitset_with_bits_past_its_values_is_dead_lettered(setup, small_schema, scorer, word):
    """country has 5 values: bit 5 and up name none. Read as set, a bit could match users of no value, or (a
    scan indexing by it) another category's; the index refuses the row, and the entry goes to the dead letters."""
    client, publisher, make = setup
    (op,) = prepare_ops(small_schema, scorer, [parse_event(upsert(667, targeting={"country": {"any_of": ["US"]}}))])
    rows = {**op.targeting.rows, "country.pos": np.full_like(op.targeting.rows["country.pos"], word)}
    client.xadd(SHARD0, encode(PreparedAd(op.ad, CompiledTargeting(rows, True), op.embedding), 1, small_schema,
                               scorer.name, scorer.dim))
    publisher.publish([upsert(1)])
    c = make()
    c.catch_up()
    assert 667 not in c.index and eligible(c.index, {"country": "US"}) == [1] and c.stats.dead_letters == 1
    (_, dead), = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert b"country.pos" in dead[b"reason"] and b"past the category's 5 values" in dead[b"reason"]


@pytest.mark.parametrize("payload", [b"", b"\x05\x00\x00\x00{bad}", b"\x0e\x00\x00\x00{\"arrays\":[]}xx",
                                     b"\x2a\x00\x00\x00{\"arrays\":[[\"embedding\",\"f4\",[9999]]]}",
                                     (100_000).to_bytes(4, "little") + b"[" * 100_000])  # nested past the recursion limit
def test_malformed_payloads_are_dead_lettered(setup, payload):
    client, publisher, make = setup
    publisher.publish([upsert(1)])
    (_, fields), = client.xrange(SHARD0)
    client.xadd(SHARD0, {**{k.decode(): v for k, v in fields.items()}, "payload": payload})
    c = make()
    c.catch_up()
    assert eligible(c.index) == [1] and c.stats.dead_letters == 1


@pytest.mark.parametrize("published_ms", [10**320, 2**53, -1, "soon", None])
def test_an_entry_whose_publish_time_is_missing_or_out_of_range_is_dead_lettered(setup, published_ms):
    """A publish time past 2**53 ms overflowed the float seconds the lag is kept in and stopped the consumer at the
    entry (and every replica starting before it); negative, not an integer or missing: the entry names the field."""
    client, publisher, make = setup
    publisher.publish([upsert(1)])
    (_, fields), = client.xrange(SHARD0)
    fields = {k.decode(): v for k, v in fields.items() if k != b"published_ms"}
    client.xadd(SHARD0, {**fields, **({} if published_ms is None else {"published_ms": str(published_ms)})})
    publisher.publish([upsert(2)])
    c = make()
    c.catch_up()
    assert eligible(c.index) == [1, 2] and c.stats.dead_letters == 1 and c.stats.lag_seconds() == 0
    (_, dead), = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert dead[b"field"] == b"published_ms"


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"),
                                   MemoryError()])
def test_a_read_that_runs_out_of_memory_is_applied_again_not_dead_lettered(setup, monkeypatch, error):
    """A table that cannot grow is no entry's fault: the read is not dead-lettered nor passed, its entries wait (the
    lag grows until the replica is unhealthy) and are applied once memory allows."""
    client, publisher, make = setup
    c = make()
    publisher.publish([upsert(1)])
    c.catch_up()
    applied = c.stats.last_id
    publisher.publish([upsert(2), upsert(3)])
    apply = c.index.apply
    monkeypatch.setattr(c.index, "apply", lambda batch: (_ for _ in ()).throw(error))
    for _ in range(2):
        with pytest.raises(type(error)):
            c.poll(block_ms=0)
    assert c.stats.last_id == applied and c.stats.dead_letters == 0 and eligible(c.index) == [1]
    time.sleep(0.2)
    assert c.stats.lag_seconds() > 0.1  # health() turns false past the replica's allowed lag
    monkeypatch.setattr(c.index, "apply", apply)
    c.poll(block_ms=0)
    assert eligible(c.index) == [1, 2, 3] and c.stats.dead_letters == 0 and c.stats.lag_seconds() == 0
    assert client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 0


def test_a_snapshot_of_another_model_is_not_loaded(setup, tmp_path, small_schema, scorer, monkeypatch):
    """Skipped from its header: its tables are never read (after a retrain every older snapshot is another model's)."""
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.publish([upsert(1)])
    writer = make(snapshots=store)
    writer.catch_up()
    writer.snapshot()
    loaded = []
    monkeypatch.setattr("index_updater.snapshots.load_snapshot",
                        lambda *args: loaded.append(args) or load_snapshot(*args))
    other = ShardConsumer(client, AdIndex(small_schema, scorer.dim), "moe-v9", snapshots=store)
    assert not other.recover() and len(other.index) == 0 and not loaded
    assert make(snapshots=store).recover() and len(loaded) == 1


def test_publish_returns_ids_in_input_order_across_shard_streams(setup):
    client, publisher, _ = setup
    publisher.shards = 3
    ids = publisher.publish([upsert(ad_id) for ad_id in range(1, 21)])
    for ad_id, entry_id in zip(range(1, 21), ids):
        (_, fields), = client.xrange(shard_stream(DEFAULT_STREAM, shard_of(ad_id, 3)), entry_id, entry_id)
        assert int(fields[b"ad_id"]) == ad_id


def test_an_entry_in_the_wrong_shard_stream_is_dead_lettered(setup, small_schema, scorer):
    client, publisher, make = setup
    stranger = next(ad_id for ad_id in range(1, 100) if shard_of(ad_id, 2) == 1)
    (op,) = prepare_ops(small_schema, scorer, [parse_event(upsert(stranger))])
    client.xadd(shard_stream(DEFAULT_STREAM, 0), encode(op, 2, small_schema, scorer.name, scorer.dim))
    c = make(0, 2)
    c.catch_up()
    assert len(c.index) == 0 and c.stats.dead_letters == 1
    (_, fields), = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert fields[b"reason"].decode() == f"ad {stranger} belongs to shard 1 of 2"


def test_a_snapshot_of_another_shard_is_not_loaded(setup, tmp_path):
    _, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.shards = 2
    publisher.publish([upsert(i) for i in range(1, 9)])
    writer = make(0, 2, snapshots=store)
    writer.catch_up()
    writer.snapshot()
    assert not make(1, 2, snapshots=store).recover() and not make(0, 1, snapshots=store).recover()
    assert make(0, 2, snapshots=store).recover()


def test_a_trim_between_the_reads_of_a_catch_up_is_a_gap(setup):
    client, publisher, make = setup
    for first in (1, 11, 21):
        publisher.publish([upsert(i) for i in range(first, first + 10)])
    c = make(count=10)
    apply_read = c._apply_read

    def trim_after_the_first_read(entries):
        newest = apply_read(entries)
        if len(c.index) == 10:  # ads 11-25 go before the next read
            client.xtrim(SHARD0, maxlen=5, approximate=False)
        return newest

    c._apply_read = trim_after_the_first_read
    with pytest.raises(StreamGap, match="trimmed"):
        c.catch_up()
    assert sorted(c.index.ad_ids()) == list(range(1, 11))  # nothing past the gap was applied as if whole


def test_a_trim_while_the_consumer_waits_is_a_gap(setup):
    client, publisher, make = setup
    publisher.publish([upsert(1)])
    c = make()
    c.catch_up()
    wait = client.xread

    def publish_and_trim_meanwhile(*args, **kwargs):  # the wait's own reply is not what gets applied
        publisher.publish([upsert(i) for i in range(2, 21)])
        client.xtrim(SHARD0, maxlen=5, approximate=False)
        return wait(*args, **kwargs)

    c.client.xread = publish_and_trim_meanwhile
    with pytest.raises(StreamGap, match="trimmed"):
        c.poll(block_ms=10)
    assert c.index.ad_ids() == [1]


def test_a_gap_no_snapshot_covers_keeps_what_the_index_applied(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.publish([upsert(i) for i in range(1, 31)])
    c = make(snapshots=store, count=10)
    c.poll(block_ms=0)
    c.snapshot()  # covers ads 1-10 only
    c.catch_up()
    publisher.publish([upsert(i) for i in range(31, 41)])
    client.xtrim(SHARD0, maxlen=5, approximate=False)  # ads 31-35 are lost to every replica
    c.start()
    try:
        assert wait_until(lambda: c.stats.gap_unrecovered and len(c.index) == 35)
        assert sorted(c.index.ad_ids()) == [*range(1, 31), *range(36, 41)]  # not the snapshot's 10 plus 36-40
        assert not c.health(60)[0]
    finally:
        c.stop()


def test_a_newer_snapshot_of_another_model_does_not_hide_an_older_valid_one(setup, tmp_path, small_schema, scorer):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.publish([upsert(i) for i in range(1, 6)])
    writer = make(snapshots=store)
    writer.catch_up()
    writer.snapshot()
    publisher.publish([upsert(6)])
    newest = client.xrevrange(SHARD0, count=1)[0][0].decode()
    store.write(AdIndex(small_schema, scorer.dim), newest, {"model": "moe-v9", "shard": 0, "shards": 1, "stream": SHARD0})
    restarted = make(snapshots=store)
    assert restarted.recover() and restarted.index.digest() == writer.index.digest()
    restarted.catch_up()
    assert len(restarted.index) == 6


def test_a_snapshot_of_another_storage_is_converted_from_float32_or_skipped(setup, tmp_path, small_schema, scorer):
    client, publisher, make = setup
    publisher.publish([upsert(i) for i in range(1, 9)])

    def replica(store: SnapshotStore | None, dtype: torch.dtype, exact: bool) -> ShardConsumer:
        index = AdIndex(small_schema, scorer.dim, embedding_dtype=dtype, exact_copy=exact)
        return ShardConsumer(client, index, scorer.name, snapshots=store)

    float32 = SnapshotStore(tmp_path / "float32")
    writer = replica(float32, torch.float32, False)
    writer.catch_up()
    writer.snapshot()
    fresh = replica(None, torch.int8, True)
    fresh.catch_up()
    restored = replica(float32, torch.int8, True)
    assert restored.recover() and restored.index.storage == "int8+exact" == fresh.index.storage
    assert restored.index.digest() == fresh.index.digest()  # the bytes an int8 replica writes itself
    lossy = SnapshotStore(tmp_path / "int8")
    writer = replica(lossy, torch.int8, False)
    writer.catch_up()
    writer.snapshot()
    skipping = replica(lossy, torch.float32, False)
    assert not skipping.recover() and len(skipping.index) == 0  # int8 holds no float32 to convert from


def test_an_entry_deleted_on_purpose_past_the_applied_id_is_not_a_gap(setup, tmp_path):
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"))
    publisher.publish([upsert(i) for i in range(1, 4)])
    c.catch_up()
    ids = publisher.publish([upsert(i) for i in range(4, 7)])
    client.xdel(SHARD0, ids[1])  # ad 5's entry, withdrawn before any replica applied it
    c.catch_up()
    assert sorted(c.index.ad_ids()) == [1, 2, 3, 4, 6] and not c.stats.gap_unrecovered
    restarted = make(snapshots=c.snapshots)
    c.snapshot()
    assert restarted.recover()
    restarted.catch_up()
    assert restarted.index.digest() == c.index.digest()


def take_copy(c: ShardConsumer) -> None:
    """What the loop's turn does once the background round's bulk copy is done: the copy finished, at what the
    consumer has applied then."""
    assert wait_until(lambda: c._copy.bulk_done)
    c.take_background_copy()


def finish_write(c: ShardConsumer) -> None:
    """The loop's next turns until the background snapshot is written (or its failure raised)."""
    assert wait_until(lambda: (c.finish_background_write(), c._writer is None)[1])


def written_round(c: ShardConsumer, claim: bool = True) -> None:
    """A turn of the loop's snapshots: the round, then (as later turns do) its background write finished."""
    c._snapshot_round(claim=claim)
    if c._writer is not None:
        finish_write(c)


def take_over_with_lost_writes(client: redis.Redis, scratch: Publisher, kept: int, new: list[tuple[str, dict]]) -> None:
    """As a Redis that lost acknowledged writes takes over (a failover, or an AOF replayed short): the shard's
    stream holds only its first `kept` entries (at their ids), then the `new` (id, event) entries, appended at those
    ids (a clock behind the old primary's gives ids before ones already read)."""
    entries = client.xrange(SHARD0)
    client.delete(SHARD0)
    for entry_id, fields in entries[:kept]:
        client.xadd(SHARD0, fields, id=entry_id)
    for entry_id, event in new:
        [(_, fields)] = client.xrange(shard_stream(scratch.stream, 0), *[scratch.publish([event])[0]] * 2)
        client.xadd(SHARD0, fields, id=entry_id)


def next_ids(stream_id: str, count: int) -> list[str]:
    ms, seq = stream_id.split("-")
    return [f"{ms}-{int(seq) + k}" for k in range(1, count + 1)]


@pytest.mark.parametrize("newest", ["before", "after"])
def test_a_stream_that_went_back_is_read_again_from_its_start(setup, tmp_path, small_schema, scorer, newest):
    # before: the new primary's newest id is before the last one read; after: a later entry passed it, and only the
    # count of entries ever added (5 where a read saw 6) tells
    client, publisher, make = setup
    ids = publisher.publish([upsert(i) for i in range(1, 7)])
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"))
    c.catch_up()
    c.snapshot()  # covers ads 1-6
    first, second = next_ids(ids[2], 2)
    if newest == "after":
        second = f"{int(ids[5].split('-')[0]) + 1}-0"
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 3,
                               [(first, upsert(7)), (second, upsert(8))])  # ad 7's id is before ad 6's
    early = make(snapshots=c.snapshots)  # a replica restarted from the old snapshot before any found the reset
    assert early.recover()
    early.catch_up()
    assert sorted(early.index.ad_ids()) == list(range(1, 9)) and early.stats.stream_resets == 1
    c.catch_up()
    assert sorted(c.index.ad_ids()) == list(range(1, 9)) and c.stats.stream_resets == 1
    assert c.stats.last_id == second and not c.stats.gap_unrecovered
    assert c.snapshots.paths() == [] and c._snapshot_now  # the old one claims ad 7's id: set aside
    fresh = make()  # ads 4-6 are lost with the writes: republishing them is the operator's part
    fresh.catch_up()
    assert sorted(fresh.index.ad_ids()) == [1, 2, 3, 7, 8] and fresh.stats.stream_resets == 0
    c.trim = True
    written_round(c, claim=False)  # what the loop's next turn does; then trims below the new snapshot
    restarted = make(snapshots=c.snapshots)
    assert restarted.recover() and restarted.stats.last_id == second
    restarted.catch_up()
    assert sorted(restarted.index.ad_ids()) == list(range(1, 9)) and restarted.stats.stream_resets == 0
    assert client.xlen(SHARD0) == 1  # trimmed below the new snapshot, not below the set-aside one
    publisher.publish([upsert(9)])
    c.catch_up()
    assert len(c.index) == 9 and c.stats.stream_resets == 1  # reading on, nothing looks like a reset again


def test_a_start_after_a_reset_goes_on_when_the_stale_snapshots_cannot_be_set_aside(setup, tmp_path, small_schema,
                                                                                   scorer, monkeypatch):
    """A read-only snapshot folder, say: the index read again from the stream's start is complete, so the start goes on
    (counted), and the loop sets them aside once it can (until 2026-12-07 the start failed, on every retry)."""
    client, publisher, make = setup
    ids = publisher.publish([upsert(i) for i in range(1, 4)])
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"))
    c.catch_up()
    c.snapshot()
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 1,
                               [(next_ids(ids[0], 1)[0], upsert(7))])
    def read_only(path):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(SnapshotStore, "set_aside_file", staticmethod(read_only))
    starting = make(snapshots=c.snapshots)
    assert starting.recover()
    starting.catch_up()
    assert sorted(starting.index.ad_ids()) == [1, 2, 3, 7] and starting.stats.stream_resets == 1
    assert starting.stats.errors == 1 and "Read-only file system" in starting.stats.last_error
    monkeypatch.undo()
    starting.settle_reset()  # the loop's next turn
    assert c.snapshots.paths() == [] and starting._snapshot_now


def test_a_snapshot_of_another_width_under_the_replicas_model_name_is_passed_over(setup, tmp_path, small_schema,
                                                                                  scorer):
    """A writer's bug or a file made by hand: its header names this replica's model, its vectors are of another width.
    The replica takes the older snapshot (until 2026-12-07 adopt's ValueError failed its start, on every retry)."""
    client, publisher, make = setup
    ids = publisher.publish([upsert(i) for i in range(1, 4)])
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"))
    c.catch_up()
    c.snapshot()
    wider = AdIndex(small_schema, scorer.dim + 8, capacity=4)
    c.snapshots.write(wider, next_ids(ids[-1], 5)[-1], {"shard": 0, "shards": 1, "model": scorer.name, "stream": SHARD0})
    restarted = make(snapshots=c.snapshots)
    assert restarted.recover() and restarted.stats.last_id == ids[-1] and len(restarted.index) == 3


def test_a_background_snapshot_is_written_from_a_copy_while_the_consumer_applies(setup, tmp_path):
    """The bulk of the copy is taken while the consumer applies; what it applied meanwhile is copied again when
    the copy is finished (between two applies), and what it applies while the copy is written is not in it."""
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), background_snapshots=True)
    publisher.publish([upsert(i) for i in range(1, 4)])
    c.catch_up()
    release, write = threading.Event(), c.snapshots.write_state
    c.snapshots.write_state = lambda *args: (release.wait(10), write(*args))[1]  # a slow volume
    c._snapshot_round()
    assert wait_until(lambda: c._copy.bulk_done)
    publisher.publish([upsert(i, version=2, title="edited") for i in range(1, 4)] + [upsert(4)])
    c.catch_up()  # after the bulk copy: rows written in place and a new one
    take_copy(c)
    covered, digest = c.stats.last_id, c.index.digest()
    publisher.publish([upsert(5), upsert(1, version=3, title="later")])
    c.catch_up()  # applies while the snapshot is being written
    assert len(c.index) == 5 and c._writer.is_alive() and not c.snapshots.paths()
    c._snapshot_round()  # the last one is still being written: this round is skipped
    release.set()
    finish_write(c)
    [path] = c.snapshots.paths()
    restored = make(snapshots=c.snapshots)
    assert restored.recover() and restored.stats.last_id == covered and restored.index.digest() == digest
    restored.catch_up()
    assert restored.index.digest() == c.index.digest()


def test_a_failed_background_snapshot_is_raised_in_the_loop_and_gives_the_round_back(setup, tmp_path):
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), background_snapshots=True, replica_id="a")
    publisher.publish([upsert(1)])
    c.catch_up()
    write = c.snapshots.write_state
    c.snapshots.write_state = lambda *args: (_ for _ in ()).throw(OSError("No space left on device"))
    c._snapshot_round()
    with pytest.raises(RuntimeError, match="No space left"):  # in the loop's thread: counted as its errors are
        finish_write(c)
    assert not c.snapshots.paths() and client.get(c.writer_key) is None  # the round is given back
    c.snapshots.write_state = write
    written_round(c)
    assert len(c.snapshots.paths()) == 1


def test_a_background_copy_of_a_table_recovered_meanwhile_writes_nothing(setup, tmp_path):
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), replica_id="a")
    publisher.publish([upsert(1)])
    c.catch_up()
    c.snapshot()
    publisher.publish([upsert(2)])
    c.catch_up()
    c._snapshot_round()
    assert wait_until(lambda: c._copy.bulk_done)
    assert c.recover()  # the snapshot of ad 1 replaces the table the copy was of
    finish_write(c)
    assert len(c.snapshots.paths()) == 1 and client.get(c.writer_key) is None  # the round is given back
    assert not c.index._exports


def test_one_replica_of_a_shard_writes_each_rounds_snapshot(setup, tmp_path):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    first, second = (make(snapshots=store, replica_id=name, snapshot_every_s=300) for name in ("a", "b"))
    publisher.publish([upsert(1)])
    for c in (first, second):
        c.catch_up()
        written_round(c)
    assert len(store.paths()) == 1 and client.get(first.writer_key) == b"a"
    assert 299_000 < client.pttl(first.writer_key) <= 300_000  # the claim lasts one round
    client.delete(first.writer_key)  # the round is over
    publisher.publish([upsert(2)])
    second.catch_up()
    written_round(second)
    assert len(store.paths()) == 2 and client.get(first.writer_key) == b"b"
    client.delete(first.writer_key)
    first.stats.gap_unrecovered = "stream trimmed up to 9-0"  # it could write no snapshot: it leaves the round
    written_round(first)
    assert client.get(first.writer_key) is None and len(store.paths()) == 2


def test_no_trim_while_a_replica_still_reads_the_stream_as_it_was(setup, tmp_path, small_schema, scorer):
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    first, second = (make(snapshots=store, replica_id=name, trim=True) for name in ("a", "b"))
    ids = publisher.publish([upsert(i) for i in range(1, 11)])
    for c in (first, second):
        c.catch_up()
    first.trim = False
    first.snapshot()  # covers ads 1-10
    first.trim = True
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 3,
                               list(zip(next_ids(ids[2], 3), [upsert(11), upsert(12), upsert(13)])))
    first.catch_up()  # finds the reset, sets the snapshot aside, asks for one
    written_round(first, claim=False)  # what its next turn does: a snapshot, then a trim
    assert len(store.paths()) == 1 and client.xlen(SHARD0) == 6  # b's applied id is of the stream as it was
    second.catch_up()
    assert sorted(second.index.ad_ids()) == list(range(1, 14)) and second.stats.stream_resets == 1
    first.trim_stream()
    assert client.xlen(SHARD0) == 1  # once b has read it again


def test_a_reset_the_newest_id_and_the_count_do_not_show_is_found_by_the_entry_at_the_applied_id(setup, tmp_path,
                                                                                               small_schema, scorer):
    # recreated with more entries than before and a newest id past the applied one, some below it
    client, publisher, make = setup
    ids = publisher.publish([upsert(i) for i in range(1, 4)])
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"))
    c.catch_up()
    c.snapshot()
    ms = int(ids[0].split("-")[0])
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 0,
                               [(f"{ms - 100 + k}-0", upsert(20 + k)) for k in range(4)] + [(f"{ms + 5000}-0", upsert(30))])
    c.catch_up()
    assert sorted(c.index.ad_ids()) == [1, 2, 3, 20, 21, 22, 23, 30] and c.stats.stream_resets == 1
    assert c.snapshots.paths() == []  # it claims ids below the new entries': set aside
    client.xdel(SHARD0, c.stats.last_id)  # an entry deleted on purpose is not a reset
    publisher.publish([upsert(4)])
    c.catch_up()
    assert len(c.index) == 9 and c.stats.stream_resets == 1


def test_a_stream_recreated_with_another_entry_at_exactly_the_applied_id_is_read_again(setup, tmp_path, small_schema,
                                                                                       scorer):
    # more entries ever added than a read saw, its newest id past the applied one, and an entry at that id: only the
    # entry there (not the one read) tells, for the replica, its snapshot and the trimming that waits on it
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    ids = publisher.publish([upsert(i) for i in range(1, 4)])
    c, other = make(snapshots=store, replica_id="a", trim=True), make(snapshots=store, replica_id="b")
    for consumer in (c, other):
        consumer.catch_up()
    c.trim = False
    c.snapshot()
    c.trim = True
    ms, seq = map(int, ids[2].split("-"))
    before = [(f"{ms - 100 + k}-0", upsert(20 + k)) for k in range(3)]
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 0,
                               [*before, (ids[2], upsert(23)), (f"{ms + 5000}-0", upsert(30))])
    assert client.xinfo_stream(SHARD0)["entries-added"] > 3 and client.xrange(SHARD0, ids[2], ids[2])
    assert c.trim_point() is None  # b's applied id is of the stream as it was
    c.catch_up()
    assert sorted(c.index.ad_ids()) == [1, 2, 3, 20, 21, 22, 23, 30] and c.stats.stream_resets == 1
    assert store.paths() == []  # it claims ids the new entries took: set aside
    restarted = make(snapshots=store)
    assert not restarted.recover()
    publisher.publish([upsert(4)])
    c.catch_up()
    assert len(c.index) == 9 and c.stats.stream_resets == 1  # reading on, nothing looks like a reset again


def test_a_background_copy_that_fails_to_finish_is_dropped_not_finished_again(setup, tmp_path, monkeypatch):
    """A finish that raises (memory, say) ends the copy: finished again at a later turn it would miss the batches
    applied in between (a torn snapshot that passes its checksum). The round is given back and the next one
    writes the table as it is; nothing of the copy is kept."""
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), replica_id="a")
    publisher.publish([upsert(1), upsert(2)])
    c.catch_up()
    c._snapshot_round()
    assert wait_until(lambda: c._copy.bulk_done)
    finished = TableCopy.finished
    monkeypatch.setattr(TableCopy, "finished", lambda *args: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        c.take_background_copy()
    monkeypatch.setattr(TableCopy, "finished", finished)
    publisher.publish([upsert(1, version=2, title="edited"), {"op": "delete", "ad_id": 2, "version": 5}])
    c.catch_up()
    finish_write(c)
    assert not c.snapshots.paths() and client.get(c.writer_key) is None and not c.index._exports
    written_round(c)
    restored = make(snapshots=c.snapshots)
    assert restored.recover() and restored.index.digest() == c.index.digest()
    assert c._copy is None and c._taken_state is None  # the copy is not kept once written


def test_stopping_drops_a_background_copy_in_progress(setup, tmp_path):
    _, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), snapshot_every_s=0.01)
    publisher.publish([upsert(i) for i in range(1, 50)])
    for _ in range(5):  # stops that land at any point of the rounds
        c.start()
        time.sleep(0.05)
        c.stop()
        assert not (c._writer and c._writer.is_alive()) and not c.index._exports
    other = make(snapshots=SnapshotStore(tmp_path / "other"))
    other.catch_up()
    other._snapshot_round(claim=False)  # a copy the loop never finishes
    assert wait_until(lambda: other._copy.bulk_done)
    other.stop()
    assert not other._writer.is_alive() and not other.index._exports and not other.snapshots.paths()


def test_entries_trimmed_from_a_stream_that_went_back_past_what_a_replica_applied_are_a_gap(setup, tmp_path):
    """The stream is lost while a replica is away; new ads go to a new one, which the others snapshot and trim. Back,
    the replica finds the stream went back and reads it from its start: what was trimmed from it is newer than all it
    had applied, so it misses those ads: unhealthy, no snapshot of its own, until a newer snapshot covers them."""
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.publish([upsert(i) for i in range(1, 11)])
    away = make(snapshots=store)
    away.catch_up()
    client.delete(SHARD0)
    ids = publisher.publish([upsert(i) for i in (100, 101, 102)])
    healthy = make(snapshots=store)
    healthy.catch_up()
    healthy.snapshot()
    client.xtrim(SHARD0, minid=ids[-1], approximate=False)  # below the healthy replica's snapshot
    away.catch_up()
    assert away.stats.stream_resets == 1 and "went back, and was trimmed up to" in away.stats.gap_unrecovered
    assert not away.health(max_lag_s=60)[0] and 102 in away.index and 100 not in away.index
    away.snapshot()
    assert len(store.paths()) == 1  # none of its own: it must not pass for a complete index
    publisher.publish([upsert(103)])
    healthy.catch_up()
    healthy.snapshot()  # newer than the newest when the gap was found
    away._turn({"sweep": float("inf"), "snapshot": float("inf"), "report": float("inf"), "trim": float("inf")})
    assert not away.stats.gap_unrecovered and {100, 101, 102, 103} <= set(away.index.ad_ids())


def test_a_stream_trimmed_only_below_what_a_replica_applied_before_it_went_back_is_no_gap(setup, small_schema, scorer):
    """A Redis restored from an older copy: its stream, trimmed as usual before the copy, holds fewer entries than a
    replica read, all at ids it had applied. Read again from its start: what was trimmed, it applied."""
    client, publisher, make = setup
    publisher.publish([upsert(i) for i in range(1, 7)])
    c = make()
    c.catch_up()
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 4, [])
    client.xtrim(SHARD0, maxlen=2, approximate=False)  # the copy holds ads 3 and 4, its first two trimmed
    c.catch_up()
    assert c.stats.stream_resets == 1 and not c.stats.gap_unrecovered and len(c.index) == 6


def test_a_background_snapshot_of_the_stream_before_it_went_back_is_set_aside(setup, tmp_path, small_schema, scorer):
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), background_snapshots=True)
    ids = publisher.publish([upsert(i) for i in range(1, 7)])
    c.catch_up()
    release, write = threading.Event(), c.snapshots.write_state
    c.snapshots.write_state = lambda *args: (release.wait(10), write(*args))[1]
    c._snapshot_round()
    take_copy(c)  # a copy of ads 1-6 at ad 6's id, being written
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 3,
                               list(zip(next_ids(ids[2], 2), [upsert(7), upsert(8)])))
    c.catch_up()
    release.set()
    finish_write(c)
    assert c.snapshots.paths() == [] and c._snapshot_now  # it landed after the reset: set aside, still asked for
    written_round(c, claim=False)
    assert len(c.snapshots.paths()) == 1 and not c._snapshot_now


def test_after_a_reset_a_poison_entry_at_an_old_id_is_dead_lettered_once_and_what_failed_is_retried(
        setup, tmp_path, small_schema, scorer):
    client, publisher, make = setup
    c = make(snapshots=SnapshotStore(tmp_path / "snapshots"), replica_id="a")
    late = make()  # another replica, which notices the reset only after c has dead-lettered what it brought
    ids = publisher.publish([upsert(i) for i in range(1, 4)])
    client.xadd(SHARD0, {"garbage": b"\xff"})
    c.catch_up()
    late.catch_up()
    c.snapshot()
    [old] = c.snapshots.paths()
    take_over_with_lost_writes(client, Publisher(client, small_schema, scorer, stream="scratch"), 1, [])
    poison = next_ids(ids[0], 1)[0]  # below the marker the first poison entry left
    client.xadd(SHARD0, {"garbage": b"\xfe"}, id=poison)
    set_aside = c.snapshots.set_aside
    c.snapshots.set_aside = lambda stale: (_ for _ in ()).throw(OSError("Read-only file system"))
    c.catch_up()  # found the reset; setting the snapshots aside failed (counted): it is still to do
    assert c._reset_pending and len(c.snapshots.paths()) == 1 and c.stats.errors == 1
    sources = [f[b"source_id"].decode() for _, f in client.xrange(f"{DEFAULT_STREAM}:dead-letters")]
    assert sources.count(poison) == 1  # a new entry at an id below the first poison entry's
    late.catch_up()
    assert late.stats.stream_resets == 1 and late.stats.dead_letters == 2  # it met both poison entries: it counts
    assert client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 2  # them, and adds neither again
    publisher.publish([upsert(4)])
    c._turn({name: 0.0 for name in ("sweep", "snapshot", "report", "trim")})  # the failure costs the turn nothing else
    assert c.stats.errors == 2 and "Read-only" in c.stats.last_error and 4 in c.index
    assert client.hget(c.applied_key, "a").decode().startswith(c.stats.last_id + " ")
    c.snapshots.set_aside = set_aside
    c.settle_reset()
    assert not c._reset_pending and old not in c.snapshots.paths() and old.with_name(f"stale-{old.name}").exists()


def test_a_full_redis_still_lets_replicas_read_start_and_trim(setup, tmp_path):
    """Past maxmemory (noeviction, as docs/operations.md sets it) Redis refuses writes and every command queued in a
    MULTI/EXEC, reads too: a replica must still read what the stream holds, a new one must still start, and the
    loop's turn must still reach the trim, which frees memory."""
    client, publisher, make = setup
    publisher.publish([upsert(i) for i in range(1, 6)])
    store = SnapshotStore(tmp_path / "snapshots", keep=1)
    running = make(snapshots=store, trim=True, replica_id="running")
    running.catch_up()
    running.snapshot()
    publisher.publish([upsert(i) for i in range(6, 9)])
    client.xadd(SHARD0, {"garbage": b"\xff"})  # poison, whose dead-letter record a full Redis refuses
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1, client.info("memory")["used_memory"] // 2))
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            publisher.publish([upsert(9)])  # refused, as documented: publish answers 503
        started = make(snapshots=store, replica_id="new")
        assert started.recover()
        started.catch_up()  # reads past the poison, though it can neither record it nor register its position yet
        assert sorted(started.index.ad_ids()) == list(range(1, 9)) and started.stats.errors == 3  # reports: of the
        # snapshot it loads, of its position once caught up; the dead letter's record
        assert started.stats.dead_letters == 1 and client.xlen(f"{DEFAULT_STREAM}:dead-letters") == 0
        assert started.stats.caught_up_to and started.stats.watermark() == started.stats.caught_up_to  # READ's clock
        running._turn({"sweep": 0.0, "snapshot": 0.0, "trim": 0.0, "report": float("inf")})
        assert sorted(running.index.ad_ids()) == list(range(1, 9)) and running.stats.dead_letters == 1
        assert "OutOfMemoryError" in running.stats.last_error  # the round's claim was refused, and the trim still
        assert running.trimmed == 4 and client.xlen(SHARD0) == 5  # done: the entries before the one the snapshot covers
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", policy)


def test_a_replica_dead_letters_what_another_training_of_its_kind_embedded(redis_server, default_schema):
    """Two trainings of one kind (same sizes and vocabulary, other weights) embed ads differently: a replica serving
    one dead-letters the entries the other's publisher wrote, naming that model, and applies its own."""
    _, client = redis_server
    scorers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        scorers.append(ModelScorer(RetrievalModel("moe", Dims(dim=8, gate=4, semantic=4, categories=4)), ["sports"],
                                   default_schema))
    ours, theirs = scorers
    assert ours.name.rsplit("-", 1)[0] == theirs.name.rsplit("-", 1)[0] and ours.name != theirs.name
    c = ShardConsumer(client, AdIndex(default_schema, ours.dim, capacity=4), ours.name, block_ms=10)
    Publisher(client, default_schema, theirs).publish([upsert(1)])
    Publisher(client, default_schema, ours).publish([upsert(2)])
    c.catch_up()
    assert 1 not in c.index and 2 in c.index and c.stats.applied == 1 and c.stats.dead_letters == 1
    (_, dead), = client.xrange(f"{DEFAULT_STREAM}:dead-letters")
    assert dead[b"field"] == b"model" and theirs.name.encode() in dead[b"reason"]


def test_snapshots_of_another_model_in_the_folder_neither_prune_a_replicas_own_nor_set_its_trim(setup, small_schema,
                                                                                                scorer, tmp_path):
    """Two deployments pointed at one snapshot folder (a rollout, by mistake): the other's newer snapshots counted
    for `keep`, so a replica's own was deleted as soon as it was written, and the stream was trimmed to snapshots
    no replica of it can load: the next replica could not start."""
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")  # keeps 3
    publisher.publish([upsert(i) for i in range(1, 11)])
    running = make(snapshots=store, replica_id="running", trim=True)
    running.catch_up()
    ms = stream_id_key(client.xrevrange(SHARD0, count=1)[0][0].decode())[0]
    for later in range(1, 4):
        store.write(AdIndex(small_schema, scorer.dim), f"{ms + later}-0",
                    {"model": "moe-v9-another", "shard": 0, "shards": 1, "stream": "another:0"})
    running.snapshot()
    assert len(store.paths()) == 4 and len(store.own(running.foreign)) == 1
    started = make(snapshots=store, replica_id="started")
    assert started.recover()
    started.catch_up()
    assert sorted(started.index.ad_ids()) == list(range(1, 11))


def test_a_replica_loading_a_snapshot_holds_the_trim_back_until_it_has_caught_up(setup, tmp_path, monkeypatch):
    """A starting replica registered only once caught up: while it loaded a large snapshot (longer than the running
    replicas' snapshot rounds) they wrote newer ones and trimmed past the one it loaded, so its catch-up met a gap,
    its start failed, and the next start the same. It now reports the snapshot's position before loading it, and
    every second until its loop runs."""
    client, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    running = make(snapshots=store, replica_id="running", trim=True, trim_keep_entries=2)
    ads = iter(range(1, 100))
    publisher.publish([upsert(next(ads)) for _ in range(5)])
    running.catch_up()
    running.snapshot()
    load = snapshots_module.load_snapshot

    def slow_load(*args):  # meanwhile the running replica applies, writes snapshots and trims, three rounds
        loaded = load(*args)
        for _ in range(3):
            publisher.publish([upsert(next(ads)) for _ in range(5)])
            running.catch_up()
            running.snapshot()
        return loaded

    monkeypatch.setattr(snapshots_module, "load_snapshot", slow_load)
    starting = make(snapshots=store, replica_id="starting", trim=True, trim_keep_entries=2)
    with starting.starting():
        assert starting.recover()
        starting.catch_up()
    assert sorted(starting.index.ad_ids()) == list(range(1, 21))
    reported = client.hget(running.applied_key, "starting").decode().split(" ")
    assert reported[0] == starting.stats.last_id and time.time() - float(reported[1]) < 5


def test_a_starting_replica_reports_its_position_every_second(setup):
    client, _, make = setup
    starting = make(replica_id="starting")
    with starting.starting():
        assert wait_until(lambda: client.hget(starting.applied_key, "starting") is not None)
        assert client.hget(starting.applied_key, "starting").decode().startswith("0-0 ")  # it needs every entry


def test_replicas_reports_are_stamped_and_judged_by_redis_clock(setup, tmp_path, monkeypatch):
    """Reports were stamped and judged by each replica's own clock: a trimming replica a couple of minutes fast took a
    live replica's fresh report for a gone one (replica_ttl_s) and trimmed past what it still needed."""
    _, publisher, make = setup
    store = SnapshotStore(tmp_path / "snapshots")
    publisher.publish([upsert(i) for i in range(1, 6)])
    behind = make(snapshots=store, replica_id="behind")
    behind.catch_up()  # reports its position
    publisher.publish([upsert(i) for i in range(6, 11)])
    leader = make(snapshots=store, replica_id="leader")
    leader.catch_up()
    leader.snapshot()
    fast = time.time() + 120
    monkeypatch.setattr(time, "time", lambda: fast)  # the leader's clock two minutes ahead (replica_ttl_s: 60)
    assert leader.trim_point() == behind.stats.last_id


def test_each_shard_part_of_a_batch_is_marked_to_end_at_its_last_entry(setup):
    client, publisher, _ = setup
    publisher.shards = 3
    publisher.publish([upsert(ad_id) for ad_id in range(1, 21)])
    for shard in range(3):
        marks = [fields.get(GOES_ON.encode()) for _, fields in client.xrange(shard_stream(DEFAULT_STREAM, shard))]
        assert len(marks) > 1 and marks == [b"1"] * (len(marks) - 1) + [None], shard


@pytest.mark.parametrize("count", [1, 3, 6])
def test_a_read_applies_whole_batches_whatever_its_count(setup, count):
    """Until 2026-12-07 a read took `count` entries and could end inside a batch: a search between two reads saw
    part of it (a stress run: 225 of 57,205 searches)."""
    _, publisher, make = setup
    first, second = [upsert(ad_id) for ad_id in range(1, 5)], [upsert(ad_id) for ad_id in range(5, 12)]
    publisher.publish(first)
    publisher.publish(second)
    c = make(count=count)
    fetch, fetched = c._fetch, []
    c._fetch = lambda after, n: (reply := fetch(after, n), fetched.append(len(reply[2]) if reply else 0))[0]
    assert c.poll(block_ms=0) == 4 and [ad for ad in range(1, 12) if ad in c.index] == [1, 2, 3, 4]
    assert c.poll(block_ms=0) == 7 and len(c.index) == 11
    assert c.poll(block_ms=0) == 0 and c.caught_up
    assert sum(fetched) <= 11 + count  # a read goes on from its last entry: only what follows the first batch's end
    # is read twice


def test_a_batch_longer_than_the_largest_read_is_applied_in_parts(setup, monkeypatch):
    _, publisher, make = setup
    monkeypatch.setattr(consumer_module, "WHOLE_BATCH_MAX", 4)
    publisher.publish([upsert(ad_id) for ad_id in range(1, 8)])
    c = make(count=2)
    assert c.poll(block_ms=0) == 4 and not c.caught_up
    assert c.poll(block_ms=0) == 3 and c.caught_up


def test_entries_without_the_mark_each_end_a_batch(setup, small_schema, scorer):
    """Entries published before 2026-12-07 carry no mark: each is a batch of its own, read `count` at a time."""
    client, _, make = setup
    for op in prepare_ops(small_schema, scorer, [parse_event(upsert(ad_id)) for ad_id in range(1, 6)]):
        client.xadd(SHARD0, encode(op, 1, small_schema, scorer.name, scorer.dim))
    c = make(count=2)
    assert [c.poll(block_ms=0) for _ in range(4)] == [2, 2, 1, 0] and len(c.index) == 5


def test_a_stream_trimmed_while_a_read_goes_on_is_a_gap_not_a_loss(setup):
    client, publisher, make = setup
    publisher.publish([upsert(ad_id) for ad_id in range(1, 7)])
    c = make(count=2)
    fetch, calls = c._fetch, []

    def trimmed_before_going_on(after, count):  # the read going on from its second entry finds it trimmed away
        calls.append(after)
        if len(calls) == 2:
            client.xtrim(SHARD0, maxlen=1, approximate=False)
        return fetch(after, count)

    c._fetch = trimmed_before_going_on
    assert c.poll(block_ms=0) == 2 and len(c.index) == 2 and not c.caught_up  # what was read, as it was read
    with pytest.raises(StreamGap, match="trimmed"):
        c.poll(block_ms=0)
