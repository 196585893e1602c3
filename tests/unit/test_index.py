"""AdIndex operations: versioned idempotency, growth, expiry, digest, atomic batches, concurrent scans."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from andromeda_core import writer
from andromeda_core.errors import InvalidInput, OutOfMemory, out_of_memory
from andromeda_core.index import AdIndex, available_memory
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.ops import OpBatch, PreparedAd
from andromeda_core.ingest import prepare_ops
from andromeda_core.targeting import CompiledTargeting, compile_targeting, compile_user
from andromeda_core.types import parse_event
from tests.conftest import apply_events, failing_write, make_ad, upsert

NOW = 10_000


def eligible(index: AdIndex, attributes: dict | None = None, now: int = NOW) -> list[int]:
    user = compile_user(index.schema, attributes or {}, {})[0]
    return index.eligible([user], [now])[0]


@pytest.fixture
def index(small_schema, scorer):
    return AdIndex(small_schema, scorer.dim, capacity=4)


def test_upsert_then_retrievable_and_edit_replaces_targeting(index, scorer):
    assert apply_events(index, scorer, [upsert(1, 1, {"country": {"any_of": ["US"]}})]) == [True]
    assert eligible(index, {"country": "US"}) == [1] and eligible(index, {"country": "CA"}) == []
    assert apply_events(index, scorer, [upsert(1, 2, {"country": {"any_of": ["CA"]}})]) == [True]
    assert eligible(index, {"country": "US"}) == [] and eligible(index, {"country": "CA"}) == [1]
    assert len(index) == 1 and index.get(1)["version"] == 2


def test_duplicate_and_out_of_order_versions_are_noops(index, scorer):
    apply_events(index, scorer, [upsert(1, 5, {"country": {"any_of": ["US"]}})])
    before = index.digest()
    assert apply_events(index, scorer, [upsert(1, 5, {"country": {"any_of": ["CA"]}}),
                                        upsert(1, 4, {"country": {"any_of": ["CA"]}}),
                                        {"op": "pause", "ad_id": 1, "version": 3},
                                        {"op": "delete", "ad_id": 1, "version": 5}]) == [False] * 4
    assert index.digest() == before and eligible(index, {"country": "US"}) == [1]


def test_pause_resume_delete(index, scorer):
    apply_events(index, scorer, [upsert(1), upsert(2)])
    assert apply_events(index, scorer, [{"op": "pause", "ad_id": 1, "version": 2}]) == [True]
    assert eligible(index) == [2] and index.get(1)["status"] == "paused"
    assert apply_events(index, scorer, [{"op": "resume", "ad_id": 1, "version": 3}]) == [True]
    assert eligible(index) == [1, 2]
    assert apply_events(index, scorer, [{"op": "delete", "ad_id": 2, "version": 2}]) == [True]
    assert eligible(index) == [1] and 2 not in index and index.version_of(2) == 2


def test_deleted_ad_is_not_resurrected_by_a_late_older_upsert(index, scorer):
    apply_events(index, scorer, [upsert(1, 1)])
    apply_events(index, scorer, [{"op": "delete", "ad_id": 1, "version": 3}])
    assert apply_events(index, scorer, [upsert(1, 2)]) == [False]
    assert eligible(index) == []
    assert apply_events(index, scorer, [upsert(1, 4)]) == [True]  # a newer one does come back
    assert eligible(index) == [1]


def test_delete_before_create_wins_over_the_older_create(index, scorer):
    assert apply_events(index, scorer, [{"op": "delete", "ad_id": 9, "version": 2}]) == [True]
    assert apply_events(index, scorer, [upsert(9, 1)]) == [False]
    assert 9 not in index


def test_a_pause_that_overtakes_the_create_still_pauses_it(index, scorer):
    """Two writers race: the pause at version 2 reaches the index before the create at version 1. The ad ends
    as the other order leaves it: paused at version 2; a resume after it applies as usual."""
    assert apply_events(index, scorer, [{"op": "pause", "ad_id": 7, "version": 2}]) == [True]
    assert len(index) == 0 and 7 not in index and index.version_of(7) == 2
    assert apply_events(index, scorer, [{"op": "pause", "ad_id": 7, "version": 2}]) == [False]  # redelivered
    assert apply_events(index, scorer, [upsert(7, 1)]) == [True]
    assert index.get(7)["status"] == "paused" and index.get(7)["version"] == 2 and eligible(index) == []
    assert apply_events(index, scorer, [{"op": "resume", "ad_id": 7, "version": 3}]) == [True]
    assert eligible(index) == [7]


def test_an_edit_that_a_newer_pause_overtook_brings_its_content_and_keeps_the_pause(index, scorer):
    apply_events(index, scorer, [upsert(1, 1, {"country": {"any_of": ["US"]}})])
    assert apply_events(index, scorer, [{"op": "pause", "ad_id": 1, "version": 3}]) == [True]
    assert apply_events(index, scorer, [upsert(1, 2, {"country": {"any_of": ["CA"]}})]) == [True]
    assert index.get(1)["status"] == "paused" and index.get(1)["version"] == 3
    assert apply_events(index, scorer, [{"op": "resume", "ad_id": 1, "version": 4}]) == [True]
    assert eligible(index, {"country": "CA"}) == [1] and eligible(index, {"country": "US"}) == []


def test_a_status_change_not_newer_than_the_content_is_stale(index, scorer):
    """At one version the upsert (which carries its own status) wins, whichever arrives first."""
    for first, second in (([upsert(1, 2)], [{"op": "pause", "ad_id": 1, "version": 2}]),
                          ([{"op": "pause", "ad_id": 1, "version": 2}], [upsert(1, 2)])):
        index = AdIndex(index.schema, scorer.dim, capacity=4)
        apply_events(index, scorer, first)
        apply_events(index, scorer, second)
        assert index.get(1)["status"] == "active" and index.version_of(1) == 2


def test_a_pause_wins_over_a_resume_at_one_version_whichever_arrives_first(index, scorer):
    """Two writers pause and resume an ad at one version: every replica ends paused, in either order, indexed or
    not yet, and a redelivery of the resume changes nothing."""
    pause, resume = {"op": "pause", "ad_id": 1, "version": 2}, {"op": "resume", "ad_id": 1, "version": 2}
    for create_first in (True, False):
        for first, second in ((pause, resume), (resume, pause)):
            index = AdIndex(index.schema, scorer.dim, capacity=4)
            if create_first:
                apply_events(index, scorer, [upsert(1, 1)])
            assert apply_events(index, scorer, [first, second]) == [True, second is pause]
            assert apply_events(index, scorer, [resume]) == [False]
            if not create_first:
                apply_events(index, scorer, [upsert(1, 1)])
            assert index.get(1)["status"] == "paused" and index.version_of(1) == 2 and eligible(index) == []

def test_expiry_between_a_pause_and_the_older_edit_it_overtook_loses_neither(index, scorer):
    """Upsert 1 (over by NOW), pause 3, a sweep, then the edit at version 2 that extends the window: the ad is live
    with the edit's window and paused, as when the edit arrives before the pause."""
    apply_events(index, scorer, [upsert(1, 1, end_time=NOW - 1), {"op": "pause", "ad_id": 1, "version": 3}])
    assert index.sweep_expired(NOW) == 1 and 1 not in index
    assert apply_events(index, scorer, [upsert(1, 2, end_time=NOW + 100)]) == [True]
    assert index.get(1)["status"] == "paused" and index.get(1)["end_time"] == NOW + 100
    assert apply_events(index, scorer, [{"op": "resume", "ad_id": 1, "version": 4}]) == [True] and eligible(index) == [1]


def test_a_status_older_than_a_delete_is_forgotten_and_a_newer_one_outlives_it(index, scorer):
    apply_events(index, scorer, [upsert(1, 1), {"op": "pause", "ad_id": 1, "version": 2},
                                 {"op": "delete", "ad_id": 1, "version": 3}, {"op": "pause", "ad_id": 2, "version": 5},
                                 upsert(2, 1), {"op": "delete", "ad_id": 2, "version": 3}])
    assert index._book.status == {2: (5, False)}  # ad 1's pause can never apply again: gone
    assert apply_events(index, scorer, [upsert(1, 4), upsert(2, 4)]) == [True, True]
    assert index.get(1)["status"] == "active" and index.get(2)["status"] == "paused"


def test_ops_within_one_batch_apply_in_order(index, scorer):
    result = apply_events(index, scorer, [upsert(1, 1), {"op": "pause", "ad_id": 1, "version": 2},
                                          upsert(1, 3, {"country": {"any_of": ["DE"]}}),
                                          {"op": "delete", "ad_id": 2, "version": 1}, upsert(2, 2)])
    assert result == [True, True, True, True, True]
    assert index.get(1)["status"] == "active" and index.get(1)["version"] == 3
    assert eligible(index, {"country": "DE"}) == [1, 2]


def test_paused_upsert_then_resume(index, scorer):
    apply_events(index, scorer, [upsert(1, 1, status="paused")])
    assert eligible(index) == []
    apply_events(index, scorer, [{"op": "resume", "ad_id": 1, "version": 2}])
    assert eligible(index) == [1]


def test_growth_past_initial_capacity_keeps_every_ad(index, scorer):
    apply_events(index, scorer, [upsert(i, targeting={"age": {"min": 13 + i % 8}}) for i in range(1, 40)])
    assert index.capacity >= 39 and len(index) == 39
    assert eligible(index, {"age": 20}) == list(range(1, 40))
    assert eligible(index, {"age": 13}) == [i for i in range(1, 40) if i % 8 == 0]


def test_a_table_past_the_available_memory_is_refused_before_it_is_allocated(small_schema, scorer, monkeypatch):
    """Allocated, it would be filled until the kernel killed the process: refused instead, naming the capacity, as
    an allocation failure (which the consumer retries, not dead-letters). A growth refused the same way changes
    nothing."""
    index = AdIndex(small_schema, scorer.dim, capacity=4)
    apply_events(index, scorer, [upsert(i) for i in (1, 2, 3)])
    per_slot = sum(column.untyped_storage().nbytes() for column in index.columns.values()) // 4
    monkeypatch.setattr("andromeda_core.index.available_memory", lambda device: 8 * per_slot)  # 7.2 slots usable
    with pytest.raises(OutOfMemory, match="a table of 8 slots needs .* add shards") as refused:
        apply_events(index, scorer, [upsert(i) for i in (4, 5, 6)])
    assert refused.value.field == "capacity" and out_of_memory(refused.value)
    assert index.capacity == 4 and eligible(index) == [1, 2, 3]
    with pytest.raises(OutOfMemory, match="a table of 8 slots .* lower the initial capacity"):
        AdIndex(small_schema, scorer.dim, capacity=8)
    assert AdIndex(small_schema, scorer.dim, capacity=7).capacity == 7


def test_the_available_memory_is_the_least_of_the_hosts_and_the_containers(tmp_path, monkeypatch):
    """A container's cgroup limit (v2, else v1) caps what the host has available; its reclaimable page cache counts as
    free; a cgroup without a limit, or none, leaves the host's."""
    cpu, host = torch.device("cpu"), 10**9
    monkeypatch.setattr("andromeda_core.index._meminfo_available", lambda: host)  # the host's, held still
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("700000\n")
    (v2 / "memory.stat").write_text("anon 500000\ninactive_file 50000\n")
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("2000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1500000\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 100000\n")
    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    assert available_memory(cpu, v2) == 350_000 and available_memory(cpu, v1) == 600_000
    assert available_memory(cpu, unlimited) == available_memory(cpu, tmp_path / "none") == host


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.int8])
def test_the_scans_embedding_rows_start_on_cache_lines_through_growth_and_restore(small_schema, storage):
    scorer = HashedTwoTower(dim=13, buckets=4096)  # 13 dims: no storage's rows are whole cache lines
    index = AdIndex(small_schema, scorer.dim, capacity=4, embedding_dtype=storage, exact_copy=False)
    apply_events(index, scorer, [upsert(i) for i in range(1, 40)])  # grown from 4 slots
    restored = AdIndex.from_state(small_schema, *index.export_state())
    for table in (index, restored):
        vectors = table.scan_columns()[4]
        assert vectors.shape == (39, 13) and vectors.stride(1) == 1
        assert vectors.data_ptr() % 64 == 0 and vectors.stride(0) * vectors.element_size() == 64
    assert torch.equal(restored.embeddings(0, 39), index.embeddings(0, 39))
    assert index.embeddings(0, 39).abs().sum(1).min() > 0  # every row written


def test_freed_slots_are_reused(index, scorer):
    apply_events(index, scorer, [upsert(i) for i in range(1, 5)])
    apply_events(index, scorer, [{"op": "delete", "ad_id": i, "version": 2} for i in range(1, 5)])
    apply_events(index, scorer, [upsert(i) for i in range(10, 14)])
    assert index.capacity == 4 and eligible(index) == [10, 11, 12, 13]


def test_time_window_and_expiry_sweep(index, scorer):
    apply_events(index, scorer, [upsert(1, start_time=NOW - 10, end_time=NOW + 10), upsert(2, end_time=NOW),
                                 upsert(3, start_time=NOW + 1)])
    assert eligible(index, now=NOW) == [1]  # end is exclusive, start inclusive
    assert eligible(index, now=NOW - 1) == [1, 2]
    assert eligible(index, now=NOW + 1) == [1, 3]
    assert index.sweep_expired(NOW) == 1 and 2 not in index and index.version_of(2) == 1
    assert apply_events(index, scorer, [upsert(2, 1, end_time=NOW + 100)]) == [False]  # stale replay stays gone
    assert apply_events(index, scorer, [upsert(2, 2, end_time=NOW + 100)]) == [True]


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.int8])
def test_a_batch_without_upserts_applies_in_every_storage_format(small_schema, scorer, storage):
    index = AdIndex(small_schema, scorer.dim, capacity=4, embedding_dtype=storage)
    apply_events(index, scorer, [upsert(1), upsert(2)])
    assert apply_events(index, scorer, [{"op": "pause", "ad_id": 1, "version": 2},
                                        {"op": "delete", "ad_id": 2, "version": 2}]) == [True, True]
    assert eligible(index) == [] and len(index) == 1


@pytest.mark.parametrize("targeting", [
    {"country": {"all_of": [["US"], ["CA"]]}},
    {"country": {"any_of": ["US"], "none_of": ["US"]}},
    {"age": {"min": 15, "max": 15, "none_of": [15]}},
    {"interests": {"all_of": [["i1"], ["i2", "i3"]], "none_of": ["i2", "i3"]}},
])
def test_unsatisfiable_targeting_never_matches(index, scorer, targeting):
    apply_events(index, scorer, [upsert(1, targeting=targeting)])
    user = {"country": "US", "age": 15, "interests": ["i1", "i2", "i3"]}
    assert eligible(index, user) == [] and index.get(1)["satisfiable"] is False


def test_digest_depends_on_content_not_slot_order(small_schema, scorer):
    events = [upsert(i, targeting={"country": {"any_of": ["US"]}}) for i in range(1, 9)]
    a, b = AdIndex(small_schema, scorer.dim, 2), AdIndex(small_schema, scorer.dim, 16)
    apply_events(a, scorer, events)
    apply_events(b, scorer, events[::-1])
    assert a.digest() == b.digest()
    apply_events(b, scorer, [{"op": "pause", "ad_id": 3, "version": 2}])
    assert a.digest() != b.digest()


def test_concurrent_reader_never_sees_a_half_written_batch(small_schema, scorer):
    """Every batch rewrites all ads to one version; a scan must see a single version across them."""
    index = AdIndex(small_schema, 4, capacity=64)

    def batch(version: int) -> list[PreparedAd]:
        ads = [parse_event(upsert(i, version, bid=float(version))).ad for i in range(1, 65)]
        return [PreparedAd(ad, compile_targeting(small_schema, {}), np.full(4, version, np.float32)) for ad in ads]

    index.apply(batch(1))
    stop, seen = threading.Event(), []

    def writer():
        for version in range(2, 60):
            index.apply(batch(version))
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not stop.is_set():
        with index.reading():
            versions = set(index.columns["version"][:64].tolist())
            bids = set(index.columns["bid"][:64].tolist())
            emb = set(index.columns["embedding"][:64].flatten().tolist())
        seen.append(len(versions))
        assert len(versions) == 1 and bids == emb == {float(v) for v in versions}
    thread.join()
    assert seen


def test_get_unknown_ad_raises_not_found(index):
    from andromeda_core.errors import NotFound

    with pytest.raises(NotFound):
        index.get(123)


def test_get_reports_indexed_state(index, scorer):
    apply_events(index, scorer, [{"op": "upsert", "ad": make_ad(5, 3, bid=2.5, start_time=1, end_time=9)}])
    state = index.get(5)
    assert (state["version"], state["bid"], state["start_time"], state["end_time"], state["status"]) == (3, 2.5, 1, 9, "active")


def test_owners_of_reports_each_ads_advertiser_and_content_version(index, scorer):
    """What the owner registry takes where newer: the advertiser of an indexed ad (paused too), none for a deleted
    or never seen one, the content version wherever one was applied, and the version of a pause or resume kept."""
    apply_events(index, scorer, [{"op": "upsert", "ad": make_ad(5, 3, advertiser_id=7)},
                                 {"op": "upsert", "ad": make_ad(6, 4, advertiser_id=8)},
                                 {"op": "upsert", "ad": make_ad(9, 1, advertiser_id=8)},
                                 {"op": "pause", "ad_id": 6, "version": 5}, {"op": "delete", "ad_id": 9, "version": 2}])
    apply_events(index, scorer, [{"op": "resume", "ad_id": 404, "version": 2}])  # kept until a newer create
    assert index.owners_of([6, 404, 5, 9, 6]) == [(8, 4, 5), (None, None, 2), (7, 3, None), (None, 2, None), (8, 4, 5)]
    assert index.owners_of([]) == []


def malformed(index: AdIndex, scorer, ad_id: int) -> PreparedAd:
    """An upsert whose country row has the wrong shape (the index must reject it)."""
    (good,) = prepare_ops(index.schema, scorer, [parse_event(upsert(ad_id))])
    return PreparedAd(good.ad, CompiledTargeting({"country.pos": np.zeros((3, 7), np.int32)}, True), good.embedding)


def test_a_batch_that_fails_changes_nothing(index, scorer):
    apply_events(index, scorer, [upsert(1), upsert(2)])
    before = index.digest()
    (delete,) = prepare_ops(index.schema, scorer, [parse_event({"op": "delete", "ad_id": 1, "version": 2})])
    with pytest.raises(InvalidInput, match="country.pos"):
        index.apply([delete, malformed(index, scorer, 3)])
    assert index.digest() == before and 1 in index and len(index) == 2 and eligible(index) == [1, 2]
    assert index.apply([delete]) == [True]  # the retried delete is not taken for stale
    assert eligible(index) == [2] and 1 not in index


def test_refusals_name_the_rows_apply_refuses_and_the_rest_applies_as_one(index, scorer):
    apply_events(index, scorer, [upsert(1)])
    before = index.digest()
    ops = prepare_ops(index.schema, scorer, [parse_event(e) for e in (
        upsert(2), {"op": "delete", "ad_id": 1, "version": 2}, upsert(3), upsert(4))])
    ops[2] = PreparedAd(ops[2].ad, ops[2].targeting, np.full_like(ops[2].embedding, np.inf))
    batch = OpBatch.from_ops(ops, index.dim, index._writer.targeting)
    with pytest.raises(InvalidInput, match="finite"):
        index.apply(batch)
    refused = index.refusals(batch)
    assert list(refused) == [2] and "finite" in str(refused[2]) and index.digest() == before
    assert index.apply(batch.take([0, 1, 3])) == [True, True, True] and eligible(index) == [2, 4]


def test_a_failing_batch_that_needed_more_slots_leaves_the_capacity_alone(index, scorer):
    apply_events(index, scorer, [upsert(i) for i in range(1, 5)])
    before, capacity, high_water = index.digest(), index.capacity, index.high_water
    (fifth,) = prepare_ops(index.schema, scorer, [parse_event(upsert(5))])
    with pytest.raises(InvalidInput):
        index.apply([fifth, malformed(index, scorer, 6)])
    assert (index.digest(), index.capacity, index.high_water, len(index)) == (before, capacity, high_water, 4)
    assert index.apply([fifth]) == [True] and eligible(index) == [1, 2, 3, 4, 5]


def test_a_sweep_whose_write_fails_changes_nothing(index, scorer, monkeypatch):
    apply_events(index, scorer, [upsert(1, end_time=NOW), upsert(2)])
    before = index.digest()

    with monkeypatch.context() as m:
        failing_write(m, on_call=1)
        with pytest.raises(RuntimeError, match="device write failed"):
            index.sweep_expired(NOW)
    assert index.digest() == before and 1 in index and len(index) == 2
    assert index.sweep_expired(NOW) == 1 and 1 not in index and eligible(index, now=NOW - 1) == [2]


def test_a_batch_whose_commit_runs_out_of_memory_changes_nothing(index, scorer, monkeypatch):
    """The consumer applies a read again after an out-of-memory error: the failed try must have taken no clause
    reference (a leaked one outlives every ad and makes each later snapshot unrestorable)."""
    apply_events(index, scorer, [upsert(1, targeting={"city": {"any_of": ["c1"]}})])
    before, in_use = index.digest(), len(index.clauses)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with monkeypatch.context() as m:
        m.setattr(writer.RowWriter, "writes", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            apply_events(index, scorer, [upsert(2, targeting={"city": {"any_of": ["c7"]}})])
    assert index.digest() == before and len(index.clauses) == in_use
    assert apply_events(index, scorer, [upsert(2, targeting={"city": {"any_of": ["c7"]}}),
                                        {"op": "delete", "ad_id": 2, "version": 2}]) == [True, True]
    assert len(index.clauses) == in_use
    AdIndex.from_state(index.schema, *index.export_state(copy=True))  # restorable: every clause has an ad


@pytest.mark.parametrize("step", ["exclusive", "cat"])
def test_a_batch_failing_on_its_way_to_the_write_gives_its_clauses_back(index, scorer, monkeypatch, step):
    """Its clauses taken beside the scans, a batch that fails before it writes (interrupted while it waits for them
    to leave, or out of memory noting its slots for an export in progress) gives them back: a leaked one outlives
    every ad. (A review found both leaking in the first version of the change that moved the interning out.)"""
    apply_events(index, scorer, [upsert(1, targeting={"city": {"any_of": ["c1"]}})])
    before, in_use = index.digest(), len(index.clauses)
    ops = prepare_ops(index.schema, scorer, [parse_event(upsert(2, targeting={"city": {"any_of": ["c7"]}}))])
    cat = torch.cat

    def fail_once_clauses_are_taken(*args, **kwargs):
        if len(index.clauses) > in_use:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return cat(*args, **kwargs)

    copy = index.begin_export()
    with monkeypatch.context() as m:
        if step == "exclusive":
            m.setattr(index._lock, "exclusive", fail_once_clauses_are_taken)
        else:
            m.setattr(torch, "cat", fail_once_clauses_are_taken)
        with pytest.raises(torch.OutOfMemoryError):
            index.apply(ops)
    index.cancel_export(copy)
    assert index.digest() == before and len(index.clauses) == in_use and 2 not in index
    assert index.apply(ops) == [True] and eligible(index, {"city": "c7"}) == [2]


def test_the_write_side_is_taken_only_in_the_writers_turn(index):
    with pytest.raises(RuntimeError, match="inside writing"):
        with index._lock.exclusive():
            pass


@pytest.mark.parametrize("write", [1, 3, 6])
def test_an_edit_whose_column_write_fails_midway_changes_nothing(index, scorer, monkeypatch, write):
    """A device write failing after some of the batch's columns were written: they are put back, so no search sees
    the new bid beside the old targeting and version."""
    apply_events(index, scorer, [upsert(1, 1, {"city": {"any_of": ["c1"]}}, bid=1.0)])
    before, state, in_use = index.digest(), index.get(1), len(index.clauses)
    with monkeypatch.context() as m:
        failing_write(m, on_call=write)
        with pytest.raises(RuntimeError, match="device write failed"):
            apply_events(index, scorer, [upsert(1, 2, {"city": {"any_of": ["c7"]}}, bid=5.0)])
    assert index.digest() == before and index.get(1) == state and len(index.clauses) == in_use
    assert eligible(index, {"city": "c1"}) == [1] and eligible(index, {"city": "c7"}) == []


def test_a_value_index_outside_its_category_is_rejected(index, scorer):
    (good,) = prepare_ops(index.schema, scorer, [parse_event(upsert(1, targeting={"city": {"any_of": ["c1"]}}))])
    rows = {**good.targeting.rows, "city.pos": np.full_like(good.targeting.rows["city.pos"], 300)}
    with pytest.raises(InvalidInput, match="city.pos"):  # a scan would index past the user's value table
        index.apply([PreparedAd(good.ad, CompiledTargeting(rows, True), good.embedding)])
    assert len(index) == 0


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def hold_reading(index: AdIndex, inside: threading.Event, release: threading.Event) -> threading.Thread:
    def scan():
        with index.reading():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=scan, daemon=True)
    thread.start()
    return thread


def test_scans_run_together_and_a_batch_waits_until_they_leave(index, scorer):
    apply_events(index, scorer, [upsert(1)])
    (op,) = prepare_ops(index.schema, scorer, [parse_event(upsert(2))])
    inside, release, written = [threading.Event(), threading.Event()], threading.Event(), threading.Event()
    try:
        readers = [hold_reading(index, event, release) for event in inside]
        assert inside[0].wait(5) and inside[1].wait(5)  # both scans are inside at once
        writer = threading.Thread(target=lambda: (index.apply([op]), written.set()), daemon=True)
        writer.start()
        assert not written.wait(0.2) and 2 not in index  # the batch waits while scans run
    finally:
        release.set()
    assert written.wait(5) and 2 in index
    for thread in [*readers, writer]:
        thread.join(5)


def test_a_scan_arriving_while_a_batch_waits_goes_after_the_batch(index, scorer):
    (op,) = prepare_ops(index.schema, scorer, [parse_event(upsert(2))])
    first_in, release, second_in, seen = threading.Event(), threading.Event(), threading.Event(), []

    def second_scan():
        with index.reading():
            seen.append(2 in index)
            second_in.set()

    try:
        first = hold_reading(index, first_in, release)
        assert first_in.wait(5)
        writer = threading.Thread(target=index.apply, args=([op],), daemon=True)
        writer.start()
        assert wait_until(lambda: index._lock._writers_waiting == 1)  # the batch now waits for the first scan
        second = threading.Thread(target=second_scan, daemon=True)
        second.start()
        assert not second_in.wait(0.2)  # writer-preferring: the new scan queues behind the waiting batch
    finally:
        release.set()
    assert second_in.wait(5) and seen == [True]  # it saw the whole batch
    for thread in (first, writer, second):
        thread.join(5)


def test_a_thread_cannot_write_inside_its_own_scan(index, scorer):
    (op,) = prepare_ops(index.schema, scorer, [parse_event(upsert(1))])
    outcome: list[str] = []

    def nested():
        with index.reading(), index.reading():  # a nested scan does not wait for itself
            try:
                index.apply([op])
            except RuntimeError as exc:
                outcome.append(str(exc))

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(5)
    assert len(outcome) == 1 and "holds a read" in outcome[0]
    assert index.apply([op]) == [True]


def paused_in(monkeypatch, index: AdIndex, step: str) -> tuple[threading.Event, threading.Event]:
    """Make the index's clause dictionary stop in its first call of `step` ("refs": a batch taking the clauses of
    its rows, before they are written; "release": dropping those of the rows it overwrote, after) until released.
    Returns (inside, release) events."""
    inside, release, original = threading.Event(), threading.Event(), getattr(index.clauses, step)

    def paused(*args):
        if not inside.is_set():
            inside.set()
            release.wait(10)
        return original(*args)

    monkeypatch.setattr(index.clauses, step, paused)
    return inside, release


def in_thread(fn, seconds: float = 5.0) -> list:
    """fn()'s result in a list, [] when it has not returned within `seconds` (it waited on a lock)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return out


@pytest.mark.parametrize("step", ["refs", "release"])
def test_scans_and_snapshots_go_on_while_a_batch_works_out_its_clauses_and_see_it_whole(index, scorer, monkeypatch,
                                                                                         step):
    """A batch takes its clauses (and releases the overwritten rows') beside the scans, holding them off only while
    it writes: a scan meanwhile sees the table before the batch (or, once written, after it), and a snapshot taken
    meanwhile restores to that same table (its dictionary leaves out the clauses no row refers to yet, or any
    more: loading refuses those). Until 2026-12-07 both waited for the whole batch."""
    us, ca = {"country": {"any_of": ["US"]}}, {"country": {"any_of": ["CA"]}}
    apply_events(index, scorer, [upsert(1, 1, us)])
    ops = prepare_ops(index.schema, scorer, [parse_event(e) for e in (upsert(1, 2, ca), upsert(2, 1, ca))])
    before = index.digest()
    inside, release = paused_in(monkeypatch, index, step)
    writer = threading.Thread(target=index.apply, args=(ops,), daemon=True)
    writer.start()
    try:
        assert inside.wait(5)
        seen = in_thread(lambda: (eligible(index, {"country": "US"}), eligible(index, {"country": "CA"})))
        state = in_thread(lambda: index.export_state(copy=True))
    finally:
        release.set()
    writer.join(5)
    whole = ([1], []) if step == "refs" else ([], [1, 2])
    assert seen == [whole]
    restored = AdIndex.from_state(index.schema, *state[0])
    assert restored.digest() == (before if step == "refs" else index.digest())
    assert eligible(restored, {"country": "US"}) == whole[0] and eligible(restored, {"country": "CA"}) == whole[1]
    assert eligible(index, {"country": "US"}) == [] and eligible(index, {"country": "CA"}) == [1, 2]


def test_batches_take_the_writers_turn_one_at_a_time(index, scorer, monkeypatch):
    """A second batch waits while the first works out its clauses: two plans of one table would each take its slots
    and versions as they were."""
    inside, release = paused_in(monkeypatch, index, "refs")
    first = threading.Thread(target=apply_events, args=(index, scorer, [upsert(1, 1)]), daemon=True)
    first.start()
    try:
        assert inside.wait(5)
        assert in_thread(lambda: apply_events(index, scorer, [upsert(2, 1)]), 0.3) == []
    finally:
        release.set()
    first.join(5)
    assert wait_until(lambda: 2 in index) and 1 in index and len(index) == 2


def test_digest_is_by_clause_content_not_clause_ids(small_schema, scorer):
    """Replicas that reached the same ads through different histories hold different clause ids (ids are
    recycled): their digests still agree, and their refs really differ."""
    x = upsert(1, targeting={"country": {"any_of": ["US"]}})
    y = upsert(2, targeting={"interests": {"any_of": ["i1"]}})
    z = upsert(3, targeting={"country": {"none_of": ["DE"]}, "interests": {"any_of": ["i2"]}})
    churned, direct = AdIndex(small_schema, scorer.dim), AdIndex(small_schema, scorer.dim)
    apply_events(churned, scorer, [x, y])
    apply_events(churned, scorer, [{"op": "delete", "ad_id": 1, "version": 2}, z])
    apply_events(direct, scorer, [y, z])
    apply_events(direct, scorer, [{"op": "delete", "ad_id": 1, "version": 2}])
    refs = [sorted(map(tuple, ix.columns["refs"][: ix.high_water].tolist())) for ix in (churned, direct)]
    assert refs[0] != refs[1] and churned.digest() == direct.digest()
    assert [churned.clauses.describe(churned.columns["refs"][churned.slot_of(3)])] == \
           [direct.clauses.describe(direct.columns["refs"][direct.slot_of(3)])]
