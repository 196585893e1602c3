"""The owner registry through a real redis-server: who may write an ad is decided where its events are appended,
so an ad published but not yet applied, or claimed by two advertisers at once, cannot change hands."""
from __future__ import annotations

import threading

import pytest

from andromeda_core.ingest import prepare_ops
from andromeda_core.sharding import shard_of
from andromeda_core.types import parse_event
from index_updater.owners import Refused, Writer, owners_key
from index_updater.publisher import Publisher
from index_updater.records import shard_stream
from tests.conftest import upsert


@pytest.fixture
def publish(redis_server, small_schema, scorer, request):
    """publish(events, advertiser=None, index_owners=None) on a 2-shard stream of this test's own."""
    _, client = redis_server
    stream = f"owners-{request.node.name}"
    publisher = Publisher(client, small_schema, scorer, shards=2, stream=stream)

    def run(events: list[dict], advertiser: int | None = None, index_owners: dict | None = None) -> list[str]:
        ops = prepare_ops(small_schema, scorer, [parse_event(e) for e in events])
        return publisher.publish_ops(ops, Writer(advertiser, index_owners))

    run.client, run.stream = client, stream
    return run


def ad(ad_id: int, version: int, advertiser: int) -> dict:
    return upsert(ad_id, version, advertiser_id=advertiser)


def owner(publish, ad_id: int) -> str | None:
    """The registry's "version advertiser" of an ad, None without an entry."""
    got = publish.client.hget(owners_key(shard_stream(publish.stream, shard_of(ad_id, 2))), ad_id)
    return got.decode() if got is not None else None


def lengths(publish) -> list[int]:
    return [publish.client.xlen(shard_stream(publish.stream, s)) for s in range(2)]


def test_an_ad_published_but_not_applied_cannot_be_claimed(publish):
    """No replica reads these streams: the index knows none of the ads, as in the second before an apply."""
    publish([ad(11, 1, 7)], advertiser=7)
    assert owner(publish, 11) == "1 7"
    with pytest.raises(Refused) as refused:
        publish([ad(11, 2, 8)], advertiser=8, index_owners={11: None})
    assert refused.value.field == "[0].ad.ad_id" and "belongs to another advertiser" in refused.value.message
    for op in ("pause", "resume", "delete"):
        with pytest.raises(Refused) as refused:
            publish([{"op": op, "ad_id": 11, "version": 3}], advertiser=8)
        assert refused.value.field == "[0].ad_id"
    assert lengths(publish) == [1 if shard_of(11, 2) == s else 0 for s in range(2)] and owner(publish, 11) == "1 7"
    publish([{"op": "pause", "ad_id": 11, "version": 2}], advertiser=7)


def test_the_registry_follows_versions_and_a_delete_frees_the_id(publish):
    publish([ad(12, 3, 9)])  # an admin writes any ad, and the registry records it
    publish([ad(12, 2, 8)])  # a stale version: the index will not apply it, and the owner stays
    assert owner(publish, 12) == "3 9"
    with pytest.raises(Refused):
        publish([ad(12, 4, 8)], advertiser=8)
    publish([{"op": "delete", "ad_id": 12, "version": 4}], advertiser=9)
    assert owner(publish, 12) == "4 "
    publish([ad(12, 5, 8)], advertiser=8)  # a deleted id is free, as in the index
    assert owner(publish, 12) == "5 8"


def test_without_an_entry_the_index_owner_decides_and_is_recorded(publish):
    """Ads published before the registry existed: the owner the index reported stands in for it."""
    with pytest.raises(Refused):
        publish([ad(13, 2, 8)], advertiser=8, index_owners={13: 7})
    with pytest.raises(Refused):
        publish([{"op": "pause", "ad_id": 13, "version": 2}], advertiser=8, index_owners={13: None})
    publish([ad(13, 2, 7)], advertiser=7, index_owners={13: 7})
    assert owner(publish, 13) == "2 7"


def test_a_refused_batch_appends_nothing_on_any_shard(publish):
    a, b = next(i for i in range(100, 200) if shard_of(i, 2) == 0), next(i for i in range(100, 200) if shard_of(i, 2) == 1)
    publish([ad(b, 1, 7)], advertiser=7)
    before = lengths(publish)
    with pytest.raises(Refused) as refused:
        publish([ad(a, 1, 8), ad(b, 2, 8)], advertiser=8)  # shard 0's part is fine, shard 1's is not
    assert refused.value.field == "[1].ad.ad_id" and lengths(publish) == before and owner(publish, a) is None


def test_two_advertisers_racing_for_new_ids_never_both_get_one(publish):
    ids, won = list(range(1000, 1040)), {7: set(), 8: set()}

    def claim(advertiser: int) -> None:
        for ad_id in ids:
            try:
                publish([ad(ad_id, advertiser, advertiser)], advertiser=advertiser)  # different versions: both
                won[advertiser].add(ad_id)  # would apply, the later one taking the ad over
            except Refused:
                pass

    threads = [threading.Thread(target=claim, args=(a,)) for a in (7, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won[7] | won[8] == set(ids) and not won[7] & won[8]
    assert all(owner(publish, i).split(" ")[1] == str(7 if i in won[7] else 8) for i in ids)
    assert sum(lengths(publish)) == len(ids)  # each refused claim appended nothing
