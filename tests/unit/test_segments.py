"""Segments: a user's cohorts and declared enum attributes, hashed the same way in training data and at
serving, and read by the MoE's segment expert."""
from __future__ import annotations

import zlib

import torch

from andromeda_core.models.segments import SEGMENTS, segment_ids
from andromeda_core.types import parse_request
from tests.unit.test_models_device import lookup, model_scorer


def test_cohorts_and_enum_attributes_only_in_schema_order(default_schema):
    attributes = {"interests": ["running", "jazz"], "age": 30, "custom_audiences": [5], "city": 7, "country": "US"}
    got = segment_ids([3, 9], attributes, default_schema)
    tokens = ["cohort=3", "cohort=9", "country=US", "interests=running", "interests=jazz"]
    assert got == [zlib.crc32(t.encode()) for t in tokens]  # age (ordinal), city and audiences (id kinds) left out
    assert segment_ids([], {}, default_schema) == []


def test_values_outside_the_vocabulary_and_repeats_are_left_out(default_schema):
    """What a request may send that training data never holds: unknown or differently cased values, other types,
    repeats; targeting ignores the same values."""
    odd = {"country": 5, "gender": True, "interests": ["running", "Running", "no-such-interest", "running"]}
    assert segment_ids([], odd, default_schema) == [zlib.crc32(b"interests=running")]


def test_at_most_segments_cohorts_first(default_schema):
    got = segment_ids(list(range(SEGMENTS + 5)), {"country": "US"}, default_schema)
    assert got == [zlib.crc32(f"cohort={c}".encode()) for c in range(SEGMENTS)]


def test_declared_interests_change_the_served_user_state(default_schema):
    scorer = model_scorer(default_schema)

    def state(attributes: dict):
        r = parse_request({"user": {"user_id": 1, "attributes": attributes}, "context": {"ts": 100}, "k": 5})
        return scorer.encode_users([r], lookup(scorer.dim), [100])

    runners, chess, nothing = state({"interests": ["running"]}), state({"interests": ["chess"]}), state({})
    segment = 1 + scorer.model.dims.interests  # the expert after the sequence and interest experts
    assert runners.mask[0, segment] and not nothing.mask[0, segment]
    assert not torch.allclose(runners.experts[0, segment], chess.experts[0, segment])
