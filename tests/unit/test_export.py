"""A table copied while it keeps applying batches (AdIndex.begin_export / finish_export) equals the table as it
is when the copy finishes: every tensor of export_state, and what a restore of it holds."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_core import export
from andromeda_core.index import AdIndex
from tests.conftest import apply_events, failing_write, upsert


def same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (ta, la), (tb, lb) = a, b
    return la == lb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


op = st.one_of(
    st.builds(lambda ad, v, a: upsert(ad, v, {"audiences": {"any_of": [a]}}), st.integers(1, 30), st.integers(1, 6),
              st.integers(0, 9)),
    st.builds(lambda kind, ad, v: {"op": kind, "ad_id": ad, "version": v}, st.sampled_from(["pause", "resume", "delete"]),
              st.integers(1, 30), st.integers(1, 6)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.lists(op, max_size=20), during=st.lists(op, max_size=20), after=st.lists(op, max_size=20),
       chunk=st.integers(1, 8))
def test_a_copy_taken_while_batches_apply_equals_the_table_when_it_finishes(small_schema, scorer, monkeypatch, before,
                                                                            during, after, chunk):
    """Batches before the export, between the chunks of its bulk copy (so rows are copied, then written) and
    after it; the table grows past its capacity, deletes free slots, new ads take them and fill past the copy's
    room."""
    monkeypatch.setattr(export, "CHUNK_ROWS", chunk)
    index = AdIndex(small_schema, scorer.dim, capacity=2)
    apply_events(index, scorer, before)
    copy = index.begin_export()
    columns, pending = copy.columns, list(during)

    class Interleaved(dict):  # each chunk of the bulk copy reads a column, then a batch is applied
        def items(self):
            for name, column in columns.items():
                if pending:
                    apply_events(index, scorer, [pending.pop()])
                yield name, column

    copy.columns = Interleaved()
    copy.copy_bulk()
    apply_events(index, scorer, pending + after)
    assert same_state(index.finish_export(copy), index.export_state(copy=True))
    assert not index._exports


def test_a_copy_made_in_another_thread_while_batches_apply_equals_the_table(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim, capacity=64)
    apply_events(index, scorer, [upsert(ad) for ad in range(1, 3000)])
    copy = index.begin_export()
    bulk = threading.Thread(target=copy.copy_bulk)
    bulk.start()
    version = 2
    while bulk.is_alive() or version < 4:
        apply_events(index, scorer, [upsert(ad, version, title=f"v{version}") for ad in range(1, 3000, 7)]
                     + [{"op": "delete", "ad_id": version, "version": 9}, upsert(10_000 + version)])
        version += 1
    bulk.join()
    assert same_state(index.finish_export(copy), index.export_state(copy=True))


def test_a_copy_of_a_table_replaced_meanwhile_is_dropped(small_schema, scorer):
    index, other = (AdIndex(small_schema, scorer.dim, capacity=4) for _ in range(2))
    apply_events(index, scorer, [upsert(1)])
    copy = index.begin_export()
    copy.copy_bulk()
    index.adopt(other)
    assert index.finish_export(copy) is None
    apply_events(index, scorer, [upsert(2)])  # nothing is noted for it any more
    assert not copy.written


def test_a_copy_that_read_a_failed_write_midway_takes_the_restored_rows(small_schema, scorer, monkeypatch):
    """A batch's column write fails after some columns were written, while the copy's bulk part (which runs without
    the lock) reads them: the index puts the old values back, and the copy takes those rows again, so the snapshot
    holds no part of the failed batch (its clause would refer to no ad and the snapshot would not load)."""
    index = AdIndex(small_schema, scorer.dim, capacity=4)
    apply_events(index, scorer, [upsert(1, 1, {"country": {"any_of": ["US"]}}, bid=1.0)])
    copy = index.begin_export()
    with monkeypatch.context() as m:
        failing_write(m, on_call=9, meanwhile=copy.copy_bulk)  # after some of the edit's columns
        with pytest.raises(RuntimeError, match="device write failed"):
            apply_events(index, scorer, [upsert(1, 2, {"country": {"any_of": ["CA"]}}, bid=5.0)])
    restored = AdIndex.from_state(small_schema, *index.finish_export(copy))
    assert restored.digest() == index.digest() and restored.get(1)["bid"] == 1.0
