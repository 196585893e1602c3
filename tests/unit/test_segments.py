"""Segments: a user's cohorts and declared enum attributes, hashed the same way in training data and at
serving, and read by the MoE's segment expert, with the text of the described ones (interests, behaviours); an ad's
mentions of described values, read by the ad tower through the same segment table."""
from __future__ import annotations

import dataclasses
import json
import re
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from andromeda_core.models.quality import checkpoint_meta
from andromeda_core.models.recdata import load_synthetic
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.segments import MENTIONS, SEGMENTS, described_values, mentions, segment_ids
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.models.train import TrainConfig, new_model, train
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_event, parse_request
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


def brute_mentions(text: str, schema) -> list[int]:
    """The described values whose words are a run of the text's words (letters and digits, case ignored), by the
    place of that run's first word, the longer value first at one place; each value once."""
    text_words = re.findall(r"[a-z0-9]+", text.lower())
    values = [(h, value.split()) for h, value in zip(*described_values(schema))]
    found = []
    for start in range(len(text_words)):
        at = [(len(value), h) for h, value in values if text_words[start:start + len(value)] == value]
        found += [h for _, h in sorted(at, key=lambda p: -p[0])]
    return list(dict.fromkeys(found))


WORDS = ["running", "Running", "gear", "yoga", "frequent", "international", "traveler", "jazz", "the", "shoes",
         "run", "ning", "_", ".", "!", "-", "running_gear", "YOGA2"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(WORDS), max_size=14), min_size=1, max_size=5),
       st.sampled_from([" ", "", ", "]))
def test_mentions_are_the_described_values_named_as_whole_words(default_schema, texts, separator):
    texts = [separator.join(t) for t in texts]
    got = mentions(texts, default_schema)
    assert got.shape == (len(texts), MENTIONS)
    for row, text in zip(got.tolist(), texts):
        want = brute_mentions(text, default_schema)[:MENTIONS]
        assert row == want + [-1] * (MENTIONS - len(want))


def test_mentions_on_hand_made_texts(default_schema):
    token = {t: zlib.crc32(t.encode()) for t in ("interests=running", "interests=running_gear", "interests=yoga",
                                                 "behaviors=frequent_international_traveler")}
    got = mentions(["Running gear for YOGA. Running!", "Frequent international traveler", "runningyoga", ""],
                   default_schema).tolist()
    assert got[0][:3] == [token["interests=running_gear"], token["interests=running"], token["interests=yoga"]]
    assert got[1][0] == token["behaviors=frequent_international_traveler"]
    assert got[2] == got[3] == [-1] * MENTIONS  # no whole word
    many = " ".join(default_schema.by_name["interests"].vocabulary[:20]).replace("_", " ")
    assert (mentions([many], default_schema) >= 0).sum() == MENTIONS  # the first MENTIONS kept


def test_an_ad_moves_with_the_segment_embeddings_of_what_it_mentions():
    """The ad tower adds the user towers' own segment embedding (one table for both sides) of the values its text
    mentions that the model holds described values for: changing the row of one value moves exactly the ads that
    mention it, by that change (the map starts as the identity) averaged over their mentions; a value it holds none
    for (a serving schema's addition) is not read, nor is any with dims.mentions = 0."""
    data = tiny_data()
    running, yoga, chess = (zlib.crc32(t.encode()) for t in ("interests=running", "interests=yoga", "interests=chess"))
    data.items.mentions = np.full((40, MENTIONS), -1, np.int64)
    data.items.mentions[0, 0] = data.items.mentions[1, 1] = running
    data.items.mentions[1, 0] = data.items.mentions[2, 0] = yoga
    data.items.mentions[3, 0] = data.items.mentions[4, 1] = chess
    data.items.mentions[4, 0] = running
    described = (np.array(sorted([running, yoga])), np.zeros((2, 384), np.float16))
    model = RetrievalModel("moe", dataclasses.replace(DIMS, mentions=MENTIONS), np.arange(1, 21), described=described)
    with torch.no_grad():
        before = model.eval().item_vectors(data.items)
        model.user_towers.segment.weight[running % DIMS.segment_buckets] += 1.0
        model.user_towers.segment.weight[chess % DIMS.segment_buckets] += 1.0
        moved = model.item_vectors(data.items) - before
    for item, share in ((0, 1.0), (1, 0.5), (4, 1.0)):  # item 1: one of its two mentions; item 4: chess not read
        assert torch.allclose(moved[item, :DIMS.dim], torch.full((DIMS.dim,), share), atol=1e-5)
    assert moved[[2, 3]].abs().max() == 0 and moved[5:].abs().max() == 0 and moved[:, DIMS.dim:].abs().max() == 0
    blind = RetrievalModel("moe", dataclasses.replace(DIMS, mentions=0), np.arange(1, 21), described=described).eval()
    blind.load_state_dict(model.state_dict())
    with torch.no_grad():
        mentioned = blind.item_vectors(data.items)
        data.items.mentions[:] = -1
        assert torch.equal(mentioned, model.item_vectors(data.items))


def test_training_moves_the_segment_rows_of_mentioned_values_through_the_ads():
    """Users here declare nothing, so only the ads' mentions can train a value's segment row: with mentions the
    mentioned value's row moves, without (Dims.mentions = 0, as MovieLens) it stays (no weight decay)."""
    running = zlib.crc32(b"interests=running")
    moved = {}
    for width in (MENTIONS, 0):
        data = tiny_data()
        data.users.segments = [[] for _ in data.users.segments]
        data.items.mentions = np.full((40, width), -1, np.int64)
        data.items.mentions[::3, :1] = running
        cfg = TrainConfig(steps=4, batch=8, negatives=4, seed=2, lr=1e-2, weight_decay=0.0, validate_every=0)
        torch.manual_seed(cfg.seed)
        row = running % Dims().segment_buckets
        start = new_model(data, "moe", cfg).user_towers.segment.weight[row].clone()
        trained = train(data, "moe", cfg, progress=False)
        moved[width] = not torch.equal(trained.user_towers.segment.weight[row], start)
        assert trained.dims.mentions == width
    assert moved == {MENTIONS: True, 0: False}


def test_publishing_embeds_an_ad_as_training_embedded_it(default_schema, tmp_path):
    """The served ad tower (ModelScorer.encode_ads, from the ad's fields) gives each ad of a world the vector
    training gives its item (RetrievalModel.item_vectors, from RecData): the same text, mentions, category,
    advertiser, bid and identity, through a checkpoint."""
    world = synthesize(WorldConfig(ads=80, users=6, seed=2), tmp_path / "w", default_schema)
    data = load_synthetic(world)
    assert (data.items.mentions >= 0).sum(1).mean() > 1  # the world's creatives name interests
    model = new_model(data, "moe", TrainConfig(min_id_engagements=1))
    with torch.no_grad():
        model.user_towers.segment.weight.normal_()
        model.ad_tower.identity.weight.normal_()
    model.save(tmp_path / "m.safetensors", checkpoint_meta(data, 0))
    scorer = ModelScorer.load(tmp_path / "m.safetensors", default_schema)
    events = [parse_event(json.loads(line)) for line in (world / "events.jsonl").read_text().splitlines()]
    ads = {e.ad.ad_id: e.ad for e in events if e.op == "upsert"}  # the latest version, as load_synthetic
    with torch.no_grad():
        want = model.item_vectors(data.items)
    got = scorer.encode_ads([ads[i] for i in data.items.ids.tolist()])
    assert torch.allclose(got, want, atol=1e-5)
