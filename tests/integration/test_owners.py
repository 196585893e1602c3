"""The owner registry through a real redis-server: who may write an ad is decided where its events are appended,
so an ad published but not yet applied, or claimed by two advertisers at once, cannot change hands."""
from __future__ import annotations

import threading

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings, strategies as st

from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.ops import OP_CODES
from andromeda_core.slots import SlotBook, SlotPlan
from andromeda_core.sharding import shard_of
from andromeda_core.types import parse_event
from index_updater.owners import Refused, Writer, owners_key
from index_updater.publisher import Publisher
from index_updater.records import shard_stream
from tests.conftest import apply_events, upsert


@pytest.fixture
def publish(redis_server, small_schema, scorer, request):
    """publish(events, advertiser=None, indexed=None, knows_index=True) on a 2-shard stream of this test's own;
    indexed: ad id -> (owner, version) as the index would report it (none reported where not given); knows_index
    False: the writer sends none, whatever `indexed` says (`andromeda publish`)."""
    _, client = redis_server
    stream = f"owners-{request.node.name}"
    publisher = Publisher(client, small_schema, scorer, shards=2, stream=stream)

    def run(events: list[dict], advertiser: int | None = None, indexed: dict | None = None,
            knows_index: bool = True) -> list[str]:
        ops = prepare_ops(small_schema, scorer, [parse_event(e) for e in events])
        return publisher.publish_ops(ops, Writer(advertiser, (indexed or {}) if knows_index else {}))

    run.client, run.stream, run.publisher = client, stream, publisher
    return run


def ad(ad_id: int, version: int, advertiser: int) -> dict:
    return upsert(ad_id, version, advertiser_id=advertiser)


def owner(publish, ad_id: int) -> str | None:
    """The registry's "version owner" of an ad, None without an entry."""
    got = publish.client.hget(owners_key(shard_stream(publish.stream, shard_of(ad_id, 2))), ad_id)
    return got.decode() if got is not None else None


def lengths(publish) -> list[int]:
    return [publish.client.xlen(shard_stream(publish.stream, s)) for s in range(2)]


def test_an_ad_claimed_between_the_check_and_its_shards_append_says_what_was_appended_before(publish, small_schema,
                                                                                           scorer):
    """The router checks every shard's part, then appends them in turn: an id claimed by another advertiser in
    between is refused at its shard's append, after the parts of shards before it were appended; the 403 says so."""
    free, claimed = (next(i for i in range(100, 200) if shard_of(i, 2) == s) for s in (0, 1))
    publish([ad(claimed, 1, 8)], advertiser=8)  # as if it came between advertiser 7's check and its append
    ops = prepare_ops(small_schema, scorer, [parse_event(ad(free, 1, 7)), parse_event(ad(claimed, 1, 7))])
    with pytest.raises(Refused) as refused:
        publish.publisher.publish_ops(ops, Writer(7, {}), checked=True)
    assert refused.value.field == "[1].ad.ad_id" and "1 event(s) of the batch, on other shards, were appended" in \
        refused.value.message and lengths(publish) == [1, 1] and owner(publish, free) == "1 7"
    with pytest.raises(Refused) as refused:  # refused at the first shard it appends to: nothing appended, as before
        publish.publisher.publish_ops(ops[1:], Writer(7, {}), checked=True)
    assert "appended" not in refused.value.message and lengths(publish) == [1, 1]


def test_an_ad_published_but_not_applied_cannot_be_claimed(publish):
    """No replica reads these streams: the index knows none of the ads, as in the second before an apply."""
    publish([ad(11, 1, 7)], advertiser=7)
    assert owner(publish, 11) == "1 7"
    with pytest.raises(Refused) as refused:
        publish([ad(11, 2, 8)], advertiser=8, indexed={11: (None, None)})
    assert refused.value.field == "[0].ad.ad_id" and "belongs to another advertiser" in refused.value.message
    for op in ("pause", "resume", "delete"):
        with pytest.raises(Refused) as refused:
            publish([{"op": op, "ad_id": 11, "version": 3}], advertiser=8)
        assert refused.value.field == "[0].ad_id" and refused.value.message == "ad 11 belongs to another advertiser"
    assert lengths(publish) == [1 if shard_of(11, 2) == s else 0 for s in range(2)] and owner(publish, 11) == "1 7"
    publish([{"op": "pause", "ad_id": 11, "version": 2}], advertiser=7)


def test_the_registry_follows_versions_as_the_index_applies_them(publish):
    publish([ad(12, 3, 9)])  # an admin writes any ad, and the registry records it
    publish([ad(12, 2, 8), ad(12, 3, 8)])  # not newer: the index will not apply them, and the owner stays
    assert owner(publish, 12) == "3 9"
    with pytest.raises(Refused):
        publish([ad(12, 4, 8)], advertiser=8)
    publish([{"op": "delete", "ad_id": 12, "version": 3}], advertiser=9)  # not newer than the upsert: a no-op
    assert owner(publish, 12) == "3 9"
    publish([{"op": "delete", "ad_id": 12, "version": 4}], advertiser=9)
    assert owner(publish, 12) == "4 "  # free
    publish([{"op": "delete", "ad_id": 12, "version": 4}], advertiser=9, indexed={12: (None, 4)})  # a resend: not
    # newer than the registry nor the index, which ignores it
    with pytest.raises(Refused):  # newer: a freed id's former owner may not pause (or delete) it past its delete,
        publish([{"op": "pause", "ad_id": 12, "version": 2**63 - 1}], advertiser=9)  # which would hold the next
    publish([ad(12, 5, 8)], advertiser=8)  # owner's ad paused; a deleted id is free, as in the index
    assert owner(publish, 12) == "5 8"
    publish([{"op": "pause", "ad_id": 12, "version": 3}], advertiser=9, indexed={12: (8, 5)})  # 9's resent pause:
    # a no-op, it passes
    with pytest.raises(Refused):  # the same where the index has not applied 8's upsert: it would pause 8's ad
        publish([{"op": "pause", "ad_id": 12, "version": 5}], advertiser=9, indexed={12: (None, 4)})
    with pytest.raises(Refused) as refused:
        publish([ad(18, 1, 7)], advertiser=8)  # an upsert naming another advertiser
    assert refused.value.field == "[0].ad.advertiser_id" and "naming it, not advertiser 7" in refused.value.message


def test_versions_past_a_lua_number_are_compared_exactly(publish):
    """Versions reach 2**63 - 1: as Lua numbers they would round (1700000000123460 to 1.7000000001235e+15), and a
    delete could be recorded newer than the upsert that follows it."""
    base = 1_700_000_000_123_000
    publish([ad(14, base, 7)], advertiser=7)
    publish([{"op": "delete", "ad_id": 14, "version": base + 460}], advertiser=7)
    publish([ad(14, base + 470, 8)], advertiser=8)  # newer than the delete: the index applies it, 8's now
    assert owner(publish, 14) == f"{base + 470} 8"
    with pytest.raises(Refused):
        publish([ad(14, base + 480, 9)], advertiser=9)
    top = 2**63 - 1
    publish([ad(15, top - 1, 7)], advertiser=7)
    publish([ad(15, top, 7)], advertiser=7)
    assert owner(publish, 15) == f"{top} 7"


def test_a_delete_older_than_the_ads_pause_or_resume_is_refused(publish):
    """In the index a pause or resume newer than a delete outlives it, so an owner pausing its ad far ahead and
    then deleting it would leave the id's next owner with its ad paused."""
    top = 2**63 - 1
    publish([ad(19, 5, 7)], advertiser=7)
    publish([{"op": "pause", "ad_id": 19, "version": 10}], advertiser=7)
    assert owner(publish, 19) == "5 7 10"
    publish([ad(19, 8, 7)], advertiser=7)  # content older than the pause: it stays paused
    assert owner(publish, 19) == "8 7 10"
    publish([{"op": "resume", "ad_id": 19, "version": top}], advertiser=7)
    with pytest.raises(Refused) as refused:
        publish([{"op": "delete", "ad_id": 19, "version": 11}], advertiser=7)
    assert refused.value.field == "[0].version" and str(top) in refused.value.message
    assert owner(publish, 19) == f"8 7 {top}"
    publish([{"op": "delete", "ad_id": 19, "version": 8}], advertiser=7, indexed={19: (7, 8, top)})  # a resend
    publish([ad(20, 5, 7), {"op": "pause", "ad_id": 20, "version": 9}, ad(20, 9, 7)], advertiser=7)
    assert owner(publish, 20) == "9 7"  # an upsert as new as the pause drops it, as the index does
    publish([{"op": "pause", "ad_id": 20, "version": 12}, {"op": "delete", "ad_id": 20, "version": 12}], advertiser=7)
    assert owner(publish, 20) == "12 "  # free, with no status left for its next owner


EVENT = st.tuples(st.sampled_from(sorted(OP_CODES)), st.integers(1, 2), st.integers(1, 6), st.sampled_from([7, 8]))
BATCHES = st.lists(st.tuples(st.sampled_from([None, "cli", 7, 8]), st.lists(EVENT, min_size=1, max_size=3)),
                   max_size=6)  # None: an admin through the router; "cli": an admin sending no index state
BEFORE = st.lists(EVENT, max_size=3)  # applied before the registry existed


def judged(writer: int | None, batch: list, book: SlotBook, owners: dict) -> tuple[SlotPlan, dict] | None:
    """The rule, told from the index's own bookkeeping: None when `writer` (None: an admin) may not append `batch`,
    else the batch's plan on `book` and the owners after it."""
    plan, owners = SlotPlan(book, 4), dict(owners)
    for kind, ad_id, version, advertiser in batch:
        applies, mine = version > plan.content_version(ad_id), owners.get(ad_id, "")
        status = plan.status_of(ad_id)
        if writer is not None and (advertiser != writer or mine not in (writer, "") if kind == "upsert" else
                                   applies and (mine != writer or kind == "delete" and status and status[0] > version)):
            return None
        plan.op(OP_CODES[kind], ad_id, version, 0)
        if applies and kind in ("upsert", "delete"):
            owners[ad_id] = advertiser if kind == "upsert" else ""
    return plan, owners


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=BEFORE, history=BATCHES)
# ads deleted before the registry existed, then written at that version by an admin without the index's state
@example(before=[("delete", 2, 1, 7)], history=[("cli", [("upsert", 2, 1, 8)]), (7, [("upsert", 2, 1, 7)])])
@example(before=[("delete", 1, 1, 7)], history=[("cli", [("upsert", 1, 1, 7)]), (None, [("delete", 1, 1, 7)])])
# a delete repeated within one advertiser's batch: the first reaches the index, the repeat no more (until 2026-12-07
# the script judged the repeat against the index's version before the batch, and refused the batch)
@example(before=[("upsert", 1, 1, 7)], history=[(7, [("delete", 1, 2, 7), ("delete", 1, 2, 7)])])
def test_the_registry_keeps_the_owners_versions_and_status_the_index_keeps(publish, before, history):
    """Ads the index took before the registry existed, then random batches by admins (with the index's state, as
    the router sends it, or without, as `andromeda publish`) and two advertisers (with it): each batch is refused
    exactly when the rule, told from the index's bookkeeping, refuses it, and the registry ends with the owner,
    version and status the index keeps for every ad whose last write carried the index's state."""
    for ad_id in (1, 2):
        publish.client.hdel(owners_key(shard_stream(publish.stream, shard_of(ad_id, 2))), ad_id)
    book, owners, knew = SlotBook(4), {}, {}
    for writer, batch in [(None, before), *history]:
        advertiser = None if writer == "cli" else writer
        expected = judged(advertiser, batch, book, owners)
        indexed = {a: (owners.get(a) if a in book.slot_of else None, book.version.get(a),
                       book.status[a][0] if a in book.status else None) for a in (1, 2)}
        try:
            if batch is not before:
                publish([ad(a, v, who) if kind == "upsert" else {"op": kind, "ad_id": a, "version": v}
                         for kind, a, v, who in batch], advertiser=advertiser, indexed=indexed,
                        knows_index=writer != "cli")
        except Refused:
            assert expected is None, (before, history, writer, batch)
            continue
        assert expected is not None, (before, history, writer, batch)
        plan, owners = expected
        plan.commit(plan.capacity_needed)
        if batch is not before:
            knew.update((a, writer != "cli") for _, a, _, _ in batch)
    for ad_id in (a for a in (1, 2) if knew.get(a)):
        recorded = (owner(publish, ad_id) or "  ").split(" ")
        content, status = book.version.get(ad_id), book.status.get(ad_id)
        assert recorded[0] == ("" if content is None else str(content)), (before, history, recorded)
        assert content is None or recorded[1] == str(owners.get(ad_id, "")), (before, history, recorded)
        assert (recorded[2:] or [""])[0] == ("" if status is None else str(status[0])), (before, history, recorded)


def test_without_an_entry_the_index_decides_and_is_recorded(publish):
    """Ads published before the registry existed: the owner and version the index reported stand in for it."""
    with pytest.raises(Refused):
        publish([ad(13, 101, 8)], advertiser=8, indexed={13: (7, 100)})
    with pytest.raises(Refused):
        publish([{"op": "pause", "ad_id": 13, "version": 101}], advertiser=8, indexed={13: (None, None)})
    publish([{"op": "delete", "ad_id": 13, "version": 50}], advertiser=7, indexed={13: (7, 100)})  # stale: the
    assert owner(publish, 13) == "100 7"  # index ignores it, so the ad stays 7's, now recorded
    with pytest.raises(Refused):
        publish([ad(13, 101, 8)], advertiser=8)
    publish([ad(13, 101, 7)], advertiser=7)
    assert owner(publish, 13) == "101 7"


def test_an_admins_write_on_an_ad_the_registry_lacks_is_recorded_as_the_index_applies_it(publish):
    """Ads published before the registry: an admin's writes through the router, which sends the index's state,
    are recorded against it; stale ones change nothing, a pause newer than the content is kept as its status."""
    publish([{"op": "delete", "ad_id": 30, "version": 5}], indexed={30: (7, 100)})  # stale: the index ignores it
    publish([ad(31, 5, 9)], indexed={31: (7, 100)})  # stale too: not 9's
    assert owner(publish, 30) == "100 7" and owner(publish, 31) == "100 7"
    with pytest.raises(Refused):
        publish([ad(30, 101, 8)], advertiser=8)
    publish([ad(31, 101, 7)], advertiser=7)
    publish([{"op": "pause", "ad_id": 21, "version": 300}], indexed={21: (7, 100)})
    assert owner(publish, 21) == "100 7 300"
    with pytest.raises(Refused):
        publish([ad(21, 301, 8)], advertiser=8, indexed={21: (7, 100)})
    with pytest.raises(Refused) as refused:
        publish([{"op": "delete", "ad_id": 21, "version": 200}], advertiser=7)
    assert refused.value.field == "[0].version"


def test_an_admins_write_without_the_indexs_state_is_recorded_and_the_index_counts_where_newer(publish):
    """`andromeda publish` reads no index: what it appends is recorded as sent. On an ad from before the registry
    a stale write records a stale state, which the index's newer one overrides at the next write that carries it;
    a write published but not yet applied is newer than anything the index reports, and holds."""
    publish([{"op": "delete", "ad_id": 32, "version": 5}], knows_index=False)  # 32 and 33 are 7's at 100
    publish([ad(33, 5, 9)], knows_index=False)
    assert owner(publish, 32) == "5 " and owner(publish, 33) == "5 9"
    with pytest.raises(Refused):
        publish([ad(32, 101, 8)], advertiser=8, indexed={32: (7, 100)})
    with pytest.raises(Refused):
        publish([ad(33, 101, 9)], advertiser=9, indexed={33: (7, 100)})
    publish([ad(33, 101, 7)], advertiser=7, indexed={33: (7, 100)})
    assert owner(publish, 33) == "101 7"
    publish([ad(34, 5, 7), {"op": "pause", "ad_id": 34, "version": 10}], knows_index=False)  # not applied yet
    with pytest.raises(Refused):
        publish([ad(34, 6, 8)], advertiser=8, indexed={34: (None, None)})
    with pytest.raises(Refused) as refused:  # the pause would outlive the delete, for the id's next owner
        publish([{"op": "delete", "ad_id": 34, "version": 7}], advertiser=7, indexed={34: (None, None)})
    assert refused.value.field == "[0].version"


def test_at_equal_versions_the_indexs_live_ad_counts(publish):
    """An admin's write at exactly the version of a live ad from before the registry: the index ignores it, the
    registry records it; the index's live ad counts, so nobody takes or changes it through that record."""
    publish([{"op": "delete", "ad_id": 40, "version": 100}], knows_index=False)  # 40 and 41 are 8's, live at 100
    publish([ad(41, 100, 7)], knows_index=False)
    assert owner(publish, 40) == "100 " and owner(publish, 41) == "100 7"
    with pytest.raises(Refused):
        publish([ad(40, 101, 7)], advertiser=7, indexed={40: (8, 100)})
    with pytest.raises(Refused):
        publish([{"op": "pause", "ad_id": 41, "version": 101}], advertiser=7, indexed={41: (8, 100)})
    publish([{"op": "pause", "ad_id": 41, "version": 101}], advertiser=8, indexed={41: (8, 100)})
    assert owner(publish, 41) == "100 8 101"


def test_an_event_the_index_would_still_apply_needs_the_ad_even_where_the_registry_is_ahead(publish):
    """8's ad at 100 in the index, the registry at 200 (an upsert it recorded that the index has not applied, or
    refused): another advertiser's pause or delete between the two would apply in the index."""
    publish([ad(42, 100, 8)], advertiser=8)
    publish([ad(42, 200, 8)], advertiser=8)
    for op in ("pause", "delete"):
        with pytest.raises(Refused):
            publish([{"op": op, "ad_id": 42, "version": 150}], advertiser=7, indexed={42: (8, 100)})
    publish([{"op": "pause", "ad_id": 42, "version": 150}], advertiser=8, indexed={42: (8, 100)})  # its owner's
    publish([{"op": "pause", "ad_id": 42, "version": 150}], advertiser=7, indexed={42: (8, 200)})  # a no-op: passes


def test_a_status_the_index_keeps_and_the_registry_lacks_refuses_an_older_delete(publish):
    """A pause the index applied that the registry never recorded (from before it, or a write Redis lost): the
    index reports it, and the owner's delete older than it is refused, as the pause would outlive it."""
    publish([ad(43, 100, 7)], advertiser=7)
    with pytest.raises(Refused) as refused:
        publish([{"op": "delete", "ad_id": 43, "version": 200}], advertiser=7, indexed={43: (7, 100, 300)})
    assert refused.value.field == "[0].version" and "300" in refused.value.message
    publish([{"op": "delete", "ad_id": 43, "version": 300}], advertiser=7, indexed={43: (7, 100, 300)})
    assert owner(publish, 43) == "300 "


def test_an_entry_holding_only_a_status_falls_back_on_the_indexs_owner(publish):
    """An admin pauses an id the index has never seen: the entry holds only the status ("  300"). Created later
    where the registry did not see it, the ad's owner and content still come from the index, with that status
    while it is newer than the content, and without it once not."""
    for ad_id in (22, 23):
        publish([{"op": "pause", "ad_id": ad_id, "version": 300}])
        assert owner(publish, ad_id) == "  300"
    with pytest.raises(Refused):
        publish([ad(22, 301, 8)], advertiser=8, indexed={22: (7, 100)})
    with pytest.raises(Refused) as refused:
        publish([{"op": "delete", "ad_id": 22, "version": 200}], advertiser=7, indexed={22: (7, 100)})
    assert refused.value.field == "[0].version"
    publish([ad(22, 150, 7)], advertiser=7, indexed={22: (7, 100)})
    assert owner(publish, 22) == "150 7 300"
    publish([{"op": "pause", "ad_id": 23, "version": 10}], advertiser=7, indexed={23: (7, 500)})  # a no-op
    assert owner(publish, 23) == "500 7"  # the index keeps no status older than the content


def test_a_malformed_registry_counts_as_none(publish):
    publish.client.hset(owners_key(shard_stream(publish.stream, shard_of(16, 2))), 16, "garbage")
    publish([ad(16, 1, 7)], advertiser=7)
    assert owner(publish, 16) == "1 7"
    stream = shard_stream(publish.stream, shard_of(17, 2))
    publish.client.delete(owners_key(stream))
    publish.client.set(owners_key(stream), "not a hash")
    publish([ad(17, 1, 7)])  # an admin's write still goes through, and the registry starts again
    assert owner(publish, 17) == "1 7"


def test_a_refused_batch_appends_nothing_on_any_shard(publish):
    a, b = next(i for i in range(100, 200) if shard_of(i, 2) == 0), next(i for i in range(100, 200) if shard_of(i, 2) == 1)
    publish([ad(b, 1, 7)], advertiser=7)
    before = lengths(publish)
    with pytest.raises(Refused) as refused:
        publish([ad(a, 1, 8), ad(b, 2, 8)], advertiser=8)  # shard 0's part is fine, shard 1's is not
    assert refused.value.field == "[1].ad.ad_id" and lengths(publish) == before and owner(publish, a) is None


def test_a_resend_after_a_lost_reply_returns_the_first_runs_ids_and_appends_nothing_again(publish, monkeypatch):
    """Each shard's script runs, then its reply is lost (a connection error): the publisher sends it again. The resend
    returns the ids the run appended, appends nothing twice, and is not refused (the advertiser's own delete had
    made the id free, so a second run refused it: a 403 for a delete that was written, and the other shard's part
    never written)."""
    a, b = next(i for i in range(100, 200) if shard_of(i, 2) == 0), next(i for i in range(100, 200) if shard_of(i, 2) == 1)
    publish([ad(a, 1, 7), ad(b, 1, 7)])
    before = lengths(publish)
    publisher = publish.publisher
    append, runs = publisher._append, []

    def run_then_lose_the_reply(**kwargs):
        reply = append(**kwargs)
        runs.append(reply)
        if len(runs) % 2:
            raise redis.ConnectionError("the reply was lost")
        return reply

    monkeypatch.setattr(publisher, "_append", run_then_lose_the_reply)
    deletes = [{"op": "delete", "ad_id": a, "version": 2}, {"op": "delete", "ad_id": b, "version": 2}]
    ids = publish(deletes, advertiser=7, indexed={a: (7, 1, None), b: (7, 1, None)})
    appends = [reply[1] for reply in runs if len(reply) == 2]  # the checks reply ["ok"] alone
    assert len(runs) == 8 and len(appends) == 4 and appends[0] == appends[1] and appends[2] == appends[3]  # each twice
    assert sorted(ids) == sorted(x.decode() for run in appends[::2] for x in run)
    assert [n - m for n, m in zip(lengths(publish), before)] == [1, 1]
    assert owner(publish, a) == "2 " and owner(publish, b) == "2 "


def test_each_shards_part_is_counted_as_appended_even_when_a_later_one_fails(publish, monkeypatch):
    """A batch spans shards and is atomic within each: when a later shard's stream fails, the parts appended before
    it are on their streams, and on_appended has counted them (the events-published metric missed them)."""
    a, b = next(i for i in range(100, 200) if shard_of(i, 2) == 0), next(i for i in range(100, 200) if shard_of(i, 2) == 1)
    publisher, counted = publish.publisher, []
    append = publisher._append
    failing = shard_stream(publish.stream, 1)

    def shard_1_down(**kwargs):
        if kwargs["keys"][0] == failing and len(kwargs["keys"]) == 3:  # its append (the check goes through)
            raise redis.ConnectionError("shard 1's Redis is down")
        return append(**kwargs)

    monkeypatch.setattr(publisher, "_append", shard_1_down)
    monkeypatch.setattr(publisher, "attempts", 1)
    ops = prepare_ops(publisher.schema, publisher.scorer, [parse_event(ad(a, 1, 7)), parse_event(ad(a + 0, 2, 7)),
                                                           parse_event(ad(b, 1, 7))])
    with pytest.raises(redis.ConnectionError):
        publisher.publish_ops(ops, on_appended=counted.append)
    assert counted == [2] and lengths(publish) == [2, 0]


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


def test_an_expired_ad_swept_from_the_index_stays_its_owners(publish, small_schema, scorer):
    """Replicas free an expired ad's slot (an hour after its end); the index then reported it as not indexed at the
    version the registry holds, and at equal versions the index counts: the id read as free, another advertiser
    could take it, and its owner could neither pause nor delete it. Through a snapshot too."""
    index = AdIndex(small_schema, scorer.dim)
    event = upsert(60, 1, advertiser_id=7, start_time=1_000, end_time=2_000)
    publish([event], advertiser=7)
    apply_events(index, scorer, [event])
    assert index.sweep_expired(5_000) == 1 and 60 not in index
    for replica in (index, AdIndex.from_state(small_schema, *index.export_state(copy=True))):
        indexed = {60: replica.owners_of([60])[0]}
        assert indexed[60] == (7, 1, None)
        with pytest.raises(Refused):
            publish([ad(60, 2, 8)], advertiser=8, indexed=indexed)
    publish([{"op": "pause", "ad_id": 60, "version": 2}], advertiser=7, indexed=indexed)
    publish([ad(60, 3, 7)], advertiser=7, indexed=indexed)  # extended by its owner
    assert owner(publish, 60) == "3 7"
    apply_events(index, scorer, [upsert(60, 3, advertiser_id=7)])
    apply_events(index, scorer, [{"op": "delete", "ad_id": 60, "version": 4}])
    assert index.owners_of([60]) == [(None, 4, None)]  # deleted: no owner any more
