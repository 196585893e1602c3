"""Segments: a user's cohorts and declared enum attributes, hashed the same way in training data and at
serving, and read by the MoE's segment expert, with the text of the described ones (interests, behaviours)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.segments import SEGMENTS, described_values, segment_ids
from andromeda_core.types import parse_request
from tests.unit.test_models import DIMS, tiny_data
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
    assert segment_ids([5, 6, 5, 5], {}, default_schema) == segment_ids([5, 6], {}, default_schema)  # cohorts too


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


def test_described_values_are_the_interest_and_behaviour_tokens_as_words(default_schema):
    hashes, texts = described_values(default_schema)
    interests, behaviors = (default_schema.by_name[n].vocabulary for n in ("interests", "behaviors"))
    assert len(hashes) == len(texts) == len(interests) + len(behaviors) and (np.diff(hashes) > 0).all()
    text_of = dict(zip(hashes.tolist(), texts))
    assert text_of[segment_ids([], {"interests": ["running_gear"]}, default_schema)[0]] == "running gear"
    assert text_of[segment_ids([], {"behaviors": [behaviors[0]]}, default_schema)[0]] == behaviors[0].replace("_", " ")
    assert segment_ids([], {"country": "US"}, default_schema)[0] not in text_of  # a country is no description


def test_the_segment_expert_reads_the_text_of_described_values():
    """A model holding texts for two values, against the same weights holding none: a user declaring one of them
    has a segment expert that moves with that value's text and with nothing else's; a value masked out, or not in
    the table (past its last hash), reads no text."""
    running, jazz, cohort = (zlib.crc32(t.encode()) for t in ("interests=running", "interests=jazz", "cohort=1"))
    hashes = np.array(sorted([running, jazz]), np.int64)
    texts = np.random.default_rng(0).standard_normal((2, 384)).astype(np.float16)
    model = RetrievalModel("moe", DIMS, described=(hashes, texts)).eval()
    bare = RetrievalModel("moe", DIMS).eval()
    bare.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("user_towers.described_")}
                         | {k: v for k, v in bare.state_dict().items() if k.startswith("user_towers.described_")})
    segment = 1 + DIMS.interests

    def experts(m: RetrievalModel, held: list[int], mask: list[bool] | None = None) -> torch.Tensor:
        stored = torch.zeros((40, DIMS.stored))
        inputs = user_inputs(tiny_data(), stored, np.array([0]), np.array([0]), DIMS.history)
        inputs.segments = torch.tensor([held])
        inputs.segment_mask = torch.tensor([mask if mask is not None else [True] * len(held)])
        with torch.no_grad():
            return m.users(inputs).experts[0, segment]

    declaring = experts(model, [cohort, running])
    assert not torch.allclose(declaring, experts(bare, [cohort, running]))  # the text term
    assert torch.allclose(experts(model, [cohort]), experts(bare, [cohort]), atol=1e-6)  # nothing described
    assert torch.allclose(experts(model, [cohort, running, -1], [True, False, False]), experts(bare, [cohort]), atol=1e-6)
    beyond = int(hashes[-1]) + 1
    assert torch.allclose(experts(model, [cohort, beyond]), experts(bare, [cohort, beyond]), atol=1e-6)
    model.user_towers.described_text[int(np.searchsorted(hashes, jazz))] = 0  # another value's text
    assert torch.equal(experts(model, [cohort, running]), declaring)
    model.user_towers.described_text[int(np.searchsorted(hashes, running))] = 0
    assert not torch.allclose(experts(model, [cohort, running]), declaring)


def test_a_described_table_must_have_a_text_per_distinct_hash():
    with pytest.raises(ValueError, match="2 described hashes but texts of shape"):
        RetrievalModel("moe", DIMS, described=(np.array([3, 7]), np.ones((1, 384), np.float16)))
    with pytest.raises(ValueError, match="distinct"):
        RetrievalModel("moe", DIMS, described=(np.array([3, 3]), np.ones((2, 384), np.float16)))
    unsorted = RetrievalModel("moe", DIMS, described=(np.array([7, 3]), np.stack([np.ones(384), np.zeros(384)])))
    assert unsorted.user_towers.described_hashes.tolist() == [3, 7]  # sorted, each text kept with its hash
    assert unsorted.user_towers.described_text[:, 0].tolist() == [0, 1]


def test_the_described_table_travels_in_the_checkpoint(tmp_path):
    hashes, texts = np.array([3, 7], np.int64), np.ones((2, 384), np.float16)
    RetrievalModel("moe", DIMS, described=(hashes, texts)).save(tmp_path / "m.safetensors")
    loaded, _ = RetrievalModel.load(tmp_path / "m.safetensors")
    assert loaded.user_towers.described_hashes.tolist() == [3, 7] and loaded.user_towers.described_text.eq(1).all()
