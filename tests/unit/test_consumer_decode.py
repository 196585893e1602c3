"""Decoding a whole read of stream entries at once (no Redis): the batch it builds applies exactly like
the prepared ops it came from, and poison entries are set aside without losing the others."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from andromeda_core.errors import ECHOED_CHARS, InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.ops import PreparedAd
from andromeda_core.types import parse_event
from andromeda_core.writer import largest_stored
from index_updater.records import EntryDecoder, InvalidRecord, encode
from tests.conftest import upsert


def as_read(fields_list: list[dict]) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Entries as XREAD returns them: ids and fields as bytes."""
    def raw(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    return [(f"{i + 1}-0".encode(), {k.encode(): raw(v) for k, v in fields.items()}) for i, fields in enumerate(fields_list)]


EVENTS = [
    upsert(1, targeting={"country": {"any_of": ["US"]}}),
    upsert(2, targeting={"age": {"min": 15}, "city": {"any_of": ["c7", "c9"]}}),
    upsert(3, status="paused", start_time=5, end_time=50),
    {"op": "pause", "ad_id": 1, "version": 2},
    upsert(4, targeting={"country": {"any_of": ["CA"]}, "audiences": {"none_of": [3]}}),
    {"op": "delete", "ad_id": 2, "version": 2},
    upsert(5, targeting={"topics": {"all_of": [["t1"], ["t2", "t3"]]}}),
    upsert(1, 3, targeting={"country": {"all_of": [["US"], ["CA"]]}}),  # unsatisfiable
    {"op": "resume", "ad_id": 9, "version": 1},
]


def test_a_decoded_read_applies_like_its_ops(small_schema, scorer):
    ops = prepare_ops(small_schema, scorer, [parse_event(e) for e in EVENTS])
    read = EntryDecoder(small_schema, scorer.name, scorer.dim).decode(
        as_read([encode(op, 1, small_schema, scorer.name, scorer.dim, 1000 + i) for i, op in enumerate(ops)]))
    direct, decoded = AdIndex(small_schema, scorer.dim, 2), AdIndex(small_schema, scorer.dim, 2)
    assert decoded.apply(read.batch) == direct.apply(ops)
    assert decoded.digest() == direct.digest() and not read.dead
    assert read.positions == list(range(len(EVENTS))) and read.published_ms == [1000 + i for i in range(len(EVENTS))]


def test_poison_entries_are_set_aside_and_the_rest_decode(small_schema, scorer):
    ops = prepare_ops(small_schema, scorer, [parse_event(upsert(i)) for i in (1, 2, 3, 4)])
    fields = [encode(op, 1, small_schema, scorer.name, scorer.dim) for op in ops]
    nan = np.full(scorer.dim, np.nan, np.float32).tobytes()
    fields[1]["payload"] = fields[1]["payload"][: -len(nan)] + nan  # a non-finite embedding
    fields[2]["payload"] = fields[2]["payload"][:-1]  # one byte short
    entries = as_read(fields[:2] + [{"garbage": b"\xff"}] + fields[2:])
    read = EntryDecoder(small_schema, scorer.name, scorer.dim).decode(entries)
    assert read.positions == [0, 4] and read.batch.ad_id.tolist() == [1, 4]
    assert [(position, exc.field) for position, exc in read.dead] == [(1, "payload.embedding"), (2, "shard"), (3, "payload")]
    assert all(isinstance(exc, InvalidRecord) for _, exc in read.dead)
    index = AdIndex(small_schema, scorer.dim)
    assert index.apply(read.batch) == [True, True] and index.ad_ids() == [1, 4]


def test_an_embedding_past_what_the_storage_holds_is_set_aside_naming_it(small_schema, scorer):
    """Finite in float32, past fp16's 65504: stored in fp16 it would be inf (until 2026-12-07 it was, and the ad scored
    NaN). An fp16 index's decoder sets the entry aside; a float32 index's takes it."""
    ops = prepare_ops(small_schema, scorer, [parse_event(upsert(i)) for i in (1, 2)])
    ops[0] = PreparedAd(ops[0].ad, ops[0].targeting, np.full(scorer.dim, 1e5, np.float32))
    entries = as_read([encode(op, 1, small_schema, scorer.name, scorer.dim) for op in ops])
    fp16 = EntryDecoder(small_schema, scorer.name, scorer.dim, largest=largest_stored(torch.float16)).decode(entries)
    assert read_ids(fp16) == [2] and [(p, e.field) for p, e in fp16.dead] == [(0, "payload.embedding")]
    assert "at most 65504" in fp16.dead[0][1].message
    assert read_ids(EntryDecoder(small_schema, scorer.name, scorer.dim).decode(entries)) == [1, 2]
    index = AdIndex(small_schema, scorer.dim, embedding_dtype=torch.float16)  # the writer's own check, for callers
    with pytest.raises(InvalidInput, match="at most 65504") as refused:  # that apply without a stream
        index.apply(ops)
    assert refused.value.field == "embedding" and len(index) == 0


def read_ids(read) -> list[int]:
    return read.batch.ad_id.tolist()


def test_a_dead_letter_reason_and_field_are_cut_whatever_the_entry_holds(small_schema, scorer):
    """A 20 MB `model` field made a 20 MB reason, in the dead-letter stream and in every replica's log."""
    fields = encode(prepare_ops(small_schema, scorer, [parse_event(upsert(1))])[0], 1, small_schema, scorer.name,
                    scorer.dim)
    read = EntryDecoder(small_schema, scorer.name, scorer.dim).decode(as_read([{**fields, "model": "m" * 1_000_000}]))
    (_, exc), = read.dead
    assert exc.field == "model" and len(exc.message) == ECHOED_CHARS and exc.message.endswith("...")
    assert len(InvalidRecord("bad", "f" * 10_000).field) == ECHOED_CHARS
