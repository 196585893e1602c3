"""`andromeda up` keeps its private Redis's demo ads only while the demo world and model that published them serve, and
`up` and `serve` refuse streams published for another shard count (a replica would set aside the ads that hash to
another shard, and serve without them)."""
from __future__ import annotations

import json
import os

import redis

from andromeda_cli.service import (clear_demo_state, demo_identity, demo_mark, other_shard_count, publish_demo,
                                   published_for_other_shards, stale_demo_state)
from andromeda_core.sharding import shard_of
from deployments.config import ServiceConfig
from index_updater.publisher import Publisher
from index_updater.records import schema_tag, shard_stream
from tests.conftest import upsert
from andromeda_core.types import parse_event


def test_ads_published_for_another_demo_world_model_or_schema_are_stale(redis_server, small_schema, scorer, tmp_path):
    server, client = redis_server
    config = ServiceConfig(redis_url=server.url if server else os.environ["REDIS_URL"], shards=2, stream="up-demo")
    model, schema = "moe-v7-0123456789ab", "andromeda-default:1:0123456789abcdef"  # ModelScorer.name, schema_tag
    published = demo_identity(tmp_path / "demo-100", model, schema)
    assert not stale_demo_state(config, published)  # empty streams: nothing stale
    Publisher(client, small_schema, scorer, shards=2, stream="up-demo").publish([parse_event(upsert(i)) for i in (1, 2, 3)])
    assert stale_demo_state(config, published)  # ads, but no record of what published them (an older up)
    client.set(demo_mark(config), published)
    assert not stale_demo_state(config, published)
    assert stale_demo_state(config.model_copy(update={"stream": "up-demo-b"}), published) is False  # empty
    Publisher(client, small_schema, scorer, shards=2, stream="up-demo-b").publish([parse_event(upsert(4))])
    assert stale_demo_state(config.model_copy(update={"stream": "up-demo-b"}), published)  # a mark per stream name
    assert stale_demo_state(config, demo_identity(tmp_path / "demo-200", model, schema))  # --demo-ads 200
    # retrained, or --model naming another checkpoint
    assert stale_demo_state(config, demo_identity(tmp_path / "demo-100", "moe-v7-ba9876543210", schema))
    edited = "andromeda-default:1:fedcba9876543210"  # the schema's vocabularies edited under the same version
    assert stale_demo_state(config, demo_identity(tmp_path / "demo-100", model, edited))
    client.delete(demo_mark(config))


def test_a_published_demo_records_what_published_it(redis_server, small_schema, scorer, tmp_path):
    """`serve --demo-ads` publishes through publish_demo as `up` does: a later `up` of the same demo finds its ads its
    own (until 2026-12-07 only up recorded them, and every up after a `serve --demo-ads` warned of them)."""
    server, client = redis_server
    config = ServiceConfig(redis_url=server.url if server else os.environ["REDIS_URL"], shards=2, stream="serve-demo")
    world = tmp_path / "demo-3"
    world.mkdir()
    (world / "events.jsonl").write_text("".join(json.dumps(upsert(i)) + "\n" for i in (1, 2, 3)))
    publish_demo(config, world, small_schema, scorer)
    assert sum(client.xlen(shard_stream("serve-demo", s)) for s in range(2)) == 3
    assert not stale_demo_state(config, demo_identity(world, scorer.name, schema_tag(small_schema)))
    assert stale_demo_state(config, demo_identity(tmp_path / "demo-4", scorer.name, schema_tag(small_schema)))
    client.delete(demo_mark(config), *(shard_stream("serve-demo", s) for s in range(2)))


def test_a_replaced_demo_model_clears_redis_and_the_shards_snapshots(redis_server, tmp_path):
    """Both hold vectors of the old model: a replica restoring a snapshot would serve them."""
    server, _ = redis_server
    url = (server.url if server else os.environ["REDIS_URL"]).rsplit("/", 1)[0] + "/15"  # a database of its own
    client = redis.Redis.from_url(url)
    client.set("andromeda:demo", b"old")
    snapshot = tmp_path / "shard-0" / "snapshot-000000000000001-0000000001.safetensors"  # as SnapshotStore names it
    snapshot.parent.mkdir()
    snapshot.write_bytes(b"old vectors")
    other = tmp_path / "shard-0" / "notes.txt"
    other.write_text("kept")
    clear_demo_state(client, tmp_path)
    assert client.dbsize() == 0 and not snapshot.exists() and other.exists()


def test_streams_published_for_another_shard_count_are_refused(redis_server, small_schema, scorer):
    server, client = redis_server
    url = server.url if server else os.environ["REDIS_URL"]
    ads = [parse_event(upsert(i)) for i in range(1, 9)]
    assert {shard_of(i, 2) for i in range(1, 9)} != {0}  # with two shards, some of them belong to shard 1
    Publisher(client, small_schema, scorer, shards=1, stream="up-one").publish(ads)
    assert published_for_other_shards(ServiceConfig(redis_url=url, shards=1, stream="up-one")) is None
    assert published_for_other_shards(ServiceConfig(redis_url=url, shards=3, stream="up-none")) is None  # no entries
    why = published_for_other_shards(ServiceConfig(redis_url=url, shards=2, stream="up-one"))
    assert why and "in the stream of shard 0 belongs to shard 1" in why
    Publisher(client, small_schema, scorer, shards=3, stream="up-three").publish(ads)
    assert published_for_other_shards(ServiceConfig(redis_url=url, shards=3, stream="up-three")) is None
    assert published_for_other_shards(ServiceConfig(redis_url=url, shards=2, stream="up-three")) == \
        "the stream of shard 2 holds entries, past the last of 2"
    client.set(shard_stream("up-one", 5), "another service's key")  # not a stream: not counted
    assert published_for_other_shards(ServiceConfig(redis_url=url, shards=1, stream="up-one")) is None
    said = other_shard_count(ServiceConfig(redis_url=url, shards=2, stream="up-one"), "republish them")
    assert said.startswith("2 shard(s)") and said.endswith("republish them")
