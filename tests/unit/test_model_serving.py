"""A model behind the retriever: results equal a brute-force scoring of the eligible ads, in every
storage format (fp32, fp16, int8 with per-ad scales)."""
from __future__ import annotations

import pytest
import torch

from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.quantization import STORAGE, round_trip
from andromeda_core.retriever import Retriever
from andromeda_core.types import parse_event, parse_request
from tests.conftest import upsert

TITLES = ["trail running shoes", "yoga mat sale", "espresso machine", "city break flights", "running watch",
          "chess lessons", "kpop concert tickets", "vegan cookbook", "electric bike", "hiking boots", "jazz vinyl"]


@pytest.fixture(scope="module")
def scorer(default_schema):
    torch.manual_seed(0)
    return ModelScorer(RetrievalModel("moe", Dims(categories=4)), ["sports", "food", "travel"], default_schema)


@pytest.fixture(scope="module")
def events():
    out = []
    for i, title in enumerate(TITLES, 1):
        event = upsert(i, title=title, targeting={"country": {"any_of": ["US"]}} if i % 3 == 0 else {})
        event["ad"]["creative"]["category"] = ["sports", "food", "travel", "unknown"][i % 4]
        out.append(parse_event(event))
    return out


def request(k=5):
    return parse_request({"user": {"user_id": 1, "attributes": {"country": "CA"},
                                   "history": [{"ad_id": 1, "event": "click", "ts": 50}, {"ad_id": 404, "event": "like", "ts": 60}],
                                   "cohorts": [7], "co_engagement": [{"surface": "reels", "ad_id": 5}]},
                          "context": {"surface": "feed", "placement": "feed_main", "ts": 3600 * 30}, "k": k})


@pytest.mark.parametrize("storage", ["fp32", "fp16", "int8"])
def test_retrieval_equals_brute_force(default_schema, scorer, events, storage):
    index = AdIndex(default_schema, scorer.dim, capacity=4, embedding_dtype=STORAGE[storage])
    index.apply(prepare_ops(default_schema, scorer, events))
    assert index.columns["embedding"].dtype == STORAGE[storage]
    response = Retriever(index, scorer, chunk_size=3).retrieve([request()])[0]
    vectors = round_trip(scorer.encode_ads([e.ad for e in events]), storage)
    users = scorer.encode_users([request()], index.embeddings_of, [3600 * 30])
    brute = scorer.score(users, vectors)[0]
    eligible = [i for i in range(len(events)) if (i + 1) % 3 != 0]  # the user is in CA, not US
    want = sorted(eligible, key=lambda i: (-brute[i].item(), i))[:5]
    assert [a.ad_id for a in response.ads] == [i + 1 for i in want]
    assert [a.score for a in response.ads] == pytest.approx([brute[i].item() for i in want], rel=1e-5, abs=1e-6)
    assert response.eligible == len(eligible)


def test_storage_formats_stay_close(default_schema, scorer, events):
    full = scorer.encode_ads([e.ad for e in events])
    for storage, tolerance in (("fp16", 1e-3), ("int8", 1e-2)):
        assert (round_trip(full, storage) - full).abs().max() < tolerance


def test_history_lookup_masks_unknown_ads(default_schema, scorer, events):
    index = AdIndex(default_schema, scorer.dim)
    index.apply(prepare_ops(default_schema, scorer, events))
    vectors, found = index.embeddings_of([1, 404, 5])
    assert found.tolist() == [True, False, True] and vectors[1].abs().sum() == 0
    state = scorer.encode_users([request()], index.embeddings_of, [3600 * 30])
    assert state.experts.shape == (1, 6, 64) and state.mask[0].tolist() == [True, True, True, True, True, True]
