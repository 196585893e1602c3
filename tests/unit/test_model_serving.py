"""A model behind the retriever: results equal a brute-force scoring of the eligible ads in every
storage format (fp32, fp16, int8 with per-block scales); lossy formats rescore the scan's shortlist
from the exact float32 copy."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from andromeda_core.errors import InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.models.retrieval import CO_ITEMS, RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.quantization import STORAGE, round_trip
from andromeda_core.retriever import Retriever
from andromeda_core.schema import DEFAULT_SCHEMA_PATH, schema_from_dict
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


def indexed(schema, scorer, events, storage="fp32", exact_copy=True):
    index = AdIndex(schema, scorer.dim, capacity=4, embedding_dtype=STORAGE[storage], exact_copy=exact_copy)
    index.apply(prepare_ops(schema, scorer, events))
    return index


ELIGIBLE = [i for i in range(len(TITLES)) if (i + 1) % 3 != 0]  # the user is in CA; every third ad wants US


def brute_force(scorer, index, vectors, k, among=ELIGIBLE):
    """Best k of `among` (event positions) scored against `vectors` (n, D): [(ad id, score)]."""
    users = scorer.encode_users([request()], index.embeddings_of, [3600 * 30])
    scores = scorer.score(users, vectors)[0]
    best = sorted(among, key=lambda i: (-scores[i].item(), i))[:k]
    return [(i + 1, scores[i].item()) for i in best]


def served(index, scorer, k, rescore=2):
    response = Retriever(index, scorer, rescore=rescore).retrieve([request(k)])[0]
    assert response.eligible == len(ELIGIBLE)
    return [(a.ad_id, a.score) for a in response.ads]


def assert_same(got, want):
    assert [i for i, _ in got] == [i for i, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("storage", ["fp32", "fp16", "int8"])
def test_scan_only_retrieval_equals_brute_force_over_stored_vectors(default_schema, scorer, events, storage):
    index = indexed(default_schema, scorer, events, storage, exact_copy=False)
    assert index.columns["embedding"].dtype == STORAGE[storage] and not index.keeps_exact
    stored = round_trip(scorer.encode_ads([e.ad for e in events]), storage)
    assert_same(served(index, scorer, 5, rescore=0), brute_force(scorer, index, stored, 5))


@pytest.mark.parametrize("storage", ["fp16", "int8"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_rescored_retrieval_is_the_exact_top_k_of_the_scan_shortlist(default_schema, scorer, events, storage, k):
    index = indexed(default_schema, scorer, events, storage)
    assert index.keeps_exact and index.columns["embedding_exact"].dtype == torch.float32
    exact = scorer.encode_ads([e.ad for e in events])
    shortlist = [i - 1 for i, _ in brute_force(scorer, index, round_trip(exact, storage), 2 * k)]
    want = brute_force(scorer, index, exact, k, among=shortlist)
    assert_same(served(index, scorer, k), want)
    # Here the shortlist holds the float32 top-k, so the answer is the float32 table's, scores included.
    assert_same(want, served(indexed(default_schema, scorer, events), scorer, k))


def test_user_towers_read_the_exact_copy(default_schema, scorer, events):
    exact = scorer.encode_ads([e.ad for e in events])
    vectors, found = indexed(default_schema, scorer, events, "int8").embeddings_of([1, 404, 5])
    assert found.tolist() == [True, False, True]
    assert torch.equal(vectors[[0, 2]], exact[[0, 4]]) and vectors[1].abs().sum() == 0
    lossy, _ = indexed(default_schema, scorer, events, "int8", exact_copy=False).embeddings_of([1])
    assert torch.equal(lossy[0], round_trip(exact, "int8")[0])


def test_storage_formats_stay_close(default_schema, scorer, events):
    full = scorer.encode_ads([e.ad for e in events])
    for storage, tolerance in (("fp16", 1e-3), ("int8", 1e-2)):
        assert (round_trip(full, storage) - full).abs().max() < tolerance * full.abs().max()  # relative to the largest


def test_history_lookup_masks_unknown_ads(default_schema, scorer, events):
    index = AdIndex(default_schema, scorer.dim)
    index.apply(prepare_ops(default_schema, scorer, events))
    vectors, found = index.embeddings_of([1, 404, 5])
    assert found.tolist() == [True, False, True] and vectors[1].abs().sum() == 0
    state = scorer.encode_users([request()], index.embeddings_of, [3600 * 30])
    assert state.experts.shape == (1, 6, 64) and state.mask[0].tolist() == [True, True, True, True, True, True]


def test_co_engagements_are_the_last_ones_the_index_holds_as_in_training(default_schema, scorer, events):
    """Training keeps a user's last CO_ITEMS co-engaged ads among those it knows; serving took the last CO_ITEMS
    given, then dropped those not indexed, so unknown ids after known ones switched the expert off."""
    index = indexed(default_schema, scorer, events)

    def state(co: list[int]):
        body = {"user": {"user_id": 1, "co_engagement": [{"surface": "reels", "ad_id": a} for a in co]},
                "context": {"ts": 3600 * 30}}
        return scorer.encode_users([parse_request(body)], index.embeddings_of, [3600 * 30])

    known, unknown = [2, 3, 4], list(range(900, 900 + CO_ITEMS))
    assert torch.equal(state(known + unknown).experts, state(known).experts)
    assert not torch.equal(state(known).experts, state([]).experts)


def test_co_engagements_with_ads_the_user_engaged_with_are_not_read_as_in_training(default_schema, scorer, events):
    """Training reads no co-engagement with an ad in the user's engagements (recdata); serving read them (a review
    found 2,363 of the default world's 4,000 requests repeating a history ad there)."""
    index = indexed(default_schema, scorer, events)

    def state(co: list[int]):
        return state_of(scorer, index, {"user": {"user_id": 1, "history": [{"ad_id": 2, "event": "click", "ts": 3600}],
                                                 "co_engagement": [{"surface": "reels", "ad_id": a} for a in co]},
                                        "context": {"ts": 3600 * 30}})

    assert torch.equal(state([2, 3]), state([3])) and not torch.equal(state([3]), state([]))
    assert torch.equal(state([2]), state([]))


def test_a_history_ad_past_its_end_is_not_found_swept_or_not(default_schema, scorer):
    """Replicas sweep expired ads at their own times: the history must not read an ad on one and not another."""
    index = AdIndex(default_schema, scorer.dim)
    ending = upsert(1, title="trail running shoes")
    ending["ad"]["end_time"] = 1000
    index.apply(prepare_ops(default_schema, scorer, [parse_event(ending), parse_event(upsert(2, title="yoga"))]))
    before = index.embeddings_of([1, 2], now=2000)
    assert before[1].tolist() == [False, True] and index.embeddings_of([1, 2], now=999)[1].tolist() == [True, True]
    index.sweep_expired(2000)
    after = index.embeddings_of([1, 2], now=2000)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_ranker_is_not_served(default_schema):
    """The ranker's head has no kernel form: serving one is refused, naming the model."""
    with pytest.raises(InvalidInput, match="ranker checkpoint is not served") as caught:
        ModelScorer(RetrievalModel("ranker", Dims(categories=4)), ["sports"], default_schema)
    assert caught.value.field == "model"


def test_the_served_name_tells_trainings_of_one_kind_apart(default_schema, tmp_path):
    """Stream entries and snapshots carry the served name, and a replica applies only its own model's: a checkpoint
    loaded again keeps its name; one weight, one buffer (the click prior), the click prior's weight (a size, not a
    tensor) or the category vocabulary changed gives another."""
    torch.manual_seed(1)
    dims = Dims(dim=8, gate=4, semantic=4, categories=4)
    model = RetrievalModel("moe", dims, click_ids=[3], click_logodds=[0.5])
    name = ModelScorer(model, ["sports"], default_schema).name
    assert name.startswith("moe-v") and len(name.rsplit("-", 1)[1]) == 12
    model.save(tmp_path / "m.safetensors", {"categories": ["sports"]})
    assert ModelScorer.load(tmp_path / "m.safetensors", default_schema).name == name
    assert ModelScorer(model, ["food"], default_schema).name != name
    reweighed = RetrievalModel("moe", dataclasses.replace(dims, click_weight=dims.click_weight + 1), click_ids=[3],
                               click_logodds=[0.5])
    reweighed.load_state_dict(model.state_dict())
    assert ModelScorer(reweighed, ["sports"], default_schema).name != name
    for tensor in (model.ad_tower.category.weight, model.click_logodds):
        kept = tensor.detach().clone()
        with torch.no_grad():
            tensor.view(-1)[0] += 1e-6
        assert ModelScorer(model, ["sports"], default_schema).name != name
        with torch.no_grad():
            tensor.copy_(kept)
    assert ModelScorer(model, ["sports"], default_schema).name == name


def test_a_checkpoint_trained_under_another_schema_serves_with_a_warning(default_schema, tmp_path, caplog):
    """Named by name and version, and by content where the checkpoint records it (a vocabulary edited under the same
    version); a checkpoint that records none warns too."""
    model = RetrievalModel("moe", Dims(dim=8, gate=4, semantic=4, categories=4))
    same = {"schema": default_schema.name, "schema_version": default_schema.version}
    for under, warned in ((same, False), (same | {"schema_fingerprint": default_schema.fingerprint}, False),
                          (same | {"schema_fingerprint": "0" * 16}, True), (same | {"schema": "other"}, True),
                          (same | {"schema_version": default_schema.version + 1}, True), ({}, True)):
        model.save(tmp_path / "m.safetensors", {"categories": ["sports"]} | under)
        caplog.clear()
        with caplog.at_level("WARNING", logger="andromeda_core.models.serving"):
            ModelScorer.load(tmp_path / "m.safetensors", default_schema)
        assert ("embeddings its towers learned are of that schema's values" in caplog.text) == warned, under


def test_warm_up_loads_the_sentence_model(scorer):
    """The router warms its scorer up at start, so the first write does not load the sentence model in its deadline."""
    from andromeda_core.models import text

    text._model.cache_clear()  # the next test to embed loads it again (seconds): the price of a test that can fail
    scorer.warm_up()
    assert text._model.cache_info().currsize == 1


def test_a_batched_request_gets_the_ads_it_gets_alone(default_schema, scorer, events):
    """The user towers run on the whole batch (their floats may round otherwise in the last bits), but each request
    keeps its own targeting, k and rescoring: batched with a request of another history, country and k, it gets the
    same ads in the same order as alone, the scores within rounding."""
    index = indexed(default_schema, scorer, events, "int8")
    other = parse_request({"user": {"user_id": 2, "attributes": {"country": "US"},
                                    "history": [{"ad_id": a, "event": "click", "ts": 10 * a} for a in (3, 6, 9, 2)]},
                           "context": {"ts": 3600 * 30}, "k": 8})
    retriever = Retriever(index, scorer, rescore=2)
    alone = [retriever.retrieve([r])[0] for r in (request(3), other)]
    together = retriever.retrieve([request(3), other])
    for a, t in zip(alone, together):
        assert [x.ad_id for x in t.ads] == [x.ad_id for x in a.ads] and t.eligible == a.eligible
        assert [x.score for x in t.ads] == pytest.approx([x.score for x in a.ads], rel=1e-5, abs=1e-6)
    assert together[1].eligible == len(TITLES)  # the US user is eligible for every ad


def state_of(scorer, index, body: dict) -> torch.Tensor:
    """The user towers' experts for one request (body: its user and context), as the router computes them."""
    r = parse_request({"k": 5, **body})
    return scorer.encode_users([r], index.embeddings_of, [r.context.ts]).experts


def test_impressions_and_hides_are_not_read_as_engagements(default_schema, scorer, events):
    """Training histories hold engagements alone: an impression or a hide must neither read as one nor push the
    engagements out of the last 50."""
    index = indexed(default_schema, scorer, events)
    clicks = [{"ad_id": i, "event": "click", "ts": 10 + i} for i in (1, 2, 3)]
    shown = [{"ad_id": 4 + i % 5, "event": ["impression", "hide"][i % 2], "ts": 100 + i} for i in range(60)]
    context = {"ts": 3600 * 30}
    alone = state_of(scorer, index, {"user": {"user_id": 1, "history": clicks}, "context": context})
    mixed = state_of(scorer, index, {"user": {"user_id": 1, "history": clicks + shown}, "context": context})
    assert torch.equal(alone, mixed)


def test_a_surface_past_the_checkpoints_rows_reads_as_unknown(default_schema, scorer, events):
    """A schema of more surfaces than the checkpoint has rows for (it was trained under another): a request naming a
    late one is served as an unknown surface, not an IndexError in the towers (a 500)."""
    raw = yaml.safe_load(DEFAULT_SCHEMA_PATH.read_text())
    surface = next(c for c in raw["categories"] if c["name"] == "surface")
    surface["vocabulary"] += [f"s{i}" for i in range(20)]
    schema = schema_from_dict(raw)
    wide = ModelScorer(scorer.model, list(scorer.categories), schema)
    index = indexed(schema, wide, events)
    user = {"user_id": 1, "history": [{"ad_id": 1, "event": "click", "ts": 5}]}
    late = state_of(wide, index, {"user": user, "context": {"ts": 100, "surface": "s19"}})
    unknown = state_of(wide, index, {"user": user, "context": {"ts": 100}})
    assert schema.by_name["surface"].value_index("s19") + 1 >= scorer.model.dims.surfaces and torch.equal(late, unknown)


def test_history_later_than_the_request_time_is_not_read(default_schema, scorer, events):
    """A request asks as of context.ts: an engagement after it had not happened then (training's histories end
    before their target). It was read as the newest engagement, with age 0."""
    index = indexed(default_schema, scorer, events)
    now = 3600 * 30
    clicks = [{"ad_id": i, "event": "click", "ts": now - 100 * i} for i in (1, 2, 3)]
    later = {"ad_id": 7, "event": "click", "ts": now + 1}
    at_now = {"ad_id": 7, "event": "click", "ts": now}

    def state(history: list[dict]) -> torch.Tensor:
        return state_of(scorer, index, {"user": {"user_id": 1, "history": history}, "context": {"ts": now}})

    assert torch.equal(state(clicks + [later]), state(clicks))
    assert not torch.equal(state(clicks + [at_now]), state(clicks))  # at its time: read


@pytest.mark.parametrize("hashed", [False, True])
def test_a_request_at_the_server_clock_reads_history_a_little_ahead_of_it(default_schema, scorer, events, hashed):
    """Without context.ts the server's clock is the request's time, and the client's clock may run ahead of it:
    entries up to CLOCK_SKEW_S past it are read, later ones are not. Both scorers."""
    from andromeda_core.models.two_tower import CLOCK_SKEW_S, HashedTwoTower

    model = HashedTwoTower(schema=default_schema) if hashed else scorer
    index = indexed(default_schema, model, events)
    now = 3600 * 30

    def state(history: list[dict]) -> torch.Tensor:
        r = parse_request({"user": {"user_id": 1, "history": history}, "k": 5})
        users = model.encode_users([r], index.embeddings_of, [now])
        return users if hashed else users.experts

    base = [{"ad_id": 1, "event": "click", "ts": now - 500}]
    assert not torch.equal(state(base + [{"ad_id": 7, "event": "click", "ts": now + CLOCK_SKEW_S}]), state(base))
    assert torch.equal(state(base + [{"ad_id": 7, "event": "click", "ts": now + CLOCK_SKEW_S + 1}]), state(base))
