from __future__ import annotations

import json

import pytest
import torch

from andromeda_core.errors import InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.quantization import STORAGE
from andromeda_core import retriever as retriever_module
from andromeda_core.retriever import (Retriever, TopK, UserQuery, compile_requests, concat_queries, exact_scores,
                                     split_topk)
from andromeda_core.types import FLOAT32_MAX, RetrieveResponse, parse_request
from tests.conftest import apply_events, upsert


def request(k: int = 10, **attributes) -> object:
    return parse_request({"user": {"user_id": 1, "attributes": attributes}, "context": {"ts": 100}, "k": k})


def test_ties_break_by_ad_id_whatever_the_slot_order(small_schema, scorer):
    events = [upsert(i, title="same words") for i in (50, 7, 31, 2, 99, 13)]
    forward, backward = AdIndex(small_schema, scorer.dim, 2), AdIndex(small_schema, scorer.dim, 2)
    apply_events(forward, scorer, events)
    apply_events(backward, scorer, events[::-1])
    got = [[a.ad_id for a in Retriever(ix, scorer).retrieve([request(k=4)])[0].ads] for ix in (forward, backward)]
    assert got == [[2, 7, 13, 31]] * 2


def test_equal_ads_score_the_same_whatever_their_slots_and_company(small_schema, scorer):
    """Ads of one creative (equal vectors) tie exactly and come out by id, on replicas of opposite slot orders: a
    float32 rescoring rounded a score differently by the candidates' count and the ad's place among them (1.0000001
    in one place, 1.0 in another), so equal ads came out in another order on another replica or shard."""
    titles = ("trail,trail watch,fast red,watch shoes,shoes blue,blue car,fast,watch car,red,shoes,shoes,watch fast,"
              "watch,fast car,red,watch,car shoes,trail fast,trail red,blue car,car,fast blue,shoes watch,blue,gold fast,"
              "trail watch,gold,red watch,fast,car,gold trail,shoes,watch,red blue,fast gold,blue,watch,shoes watch,"
              "watch car").split(",")  # a set on which the float32 rescoring ordered equal ads apart
    events = [upsert(i, title=title) for i, title in enumerate(titles, 1)]
    forward, backward = AdIndex(small_schema, scorer.dim, 2), AdIndex(small_schema, scorer.dim, 2)
    apply_events(forward, scorer, events)
    apply_events(backward, scorer, events[::-1])
    body = {"user": {"user_id": 1, "history": [{"ad_id": 1, "event": "click", "ts": 5}]}, "context": {"ts": 100}}
    for k in (3, 39):
        got = [Retriever(ix, scorer).retrieve([parse_request({**body, "k": k})])[0].ads for ix in (forward, backward)]
        assert got[0] == got[1]
        by_title = {}
        for ad in got[0]:
            by_title.setdefault(titles[ad.ad_id - 1], set()).add(ad.score)
        assert all(len(scores) == 1 for scores in by_title.values())


def test_exact_scores_of_a_candidate_do_not_depend_on_its_company(scorer):
    gen = torch.Generator().manual_seed(0)
    users, ads = torch.randn((1, scorer.dim), generator=gen), torch.randn((26, scorer.dim), generator=gen)
    ads[25] = ads[0]
    many = exact_scores(scorer, users, ads[None], torch.ones((1, 26), dtype=torch.bool))[0]
    two = exact_scores(scorer, users, ads[None, :2], torch.ones((1, 2), dtype=torch.bool))[0]
    assert many[0] == many[25] == two[0] and torch.allclose(many, scorer.score(users, ads)[0])


def test_the_default_scorer_leaves_out_values_targeting_ignores_and_repeats(small_schema):
    """With its schema the untrained two-tower reads a user's interests as targeting does: an unknown value (which
    "matches nothing") and a repeat moved every score."""
    two_tower = HashedTwoTower(dim=16, buckets=4096, schema=small_schema)
    known = next(c for c in small_schema.categories if c.name == "interests").vocabulary[0]

    def user(values: list[str]) -> torch.Tensor:
        request = parse_request({"user": {"user_id": 1, "attributes": {"interests": values}}})
        return two_tower.encode_users([request], lambda ids: (torch.zeros((len(ids), 16)), torch.zeros(len(ids), dtype=torch.bool)), [0])

    assert torch.equal(user([known, "zz_not_a_value", known]), user([known]))
    assert not torch.equal(user([known]), user([]))


def test_fewer_eligible_than_k_and_empty_index(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    assert Retriever(index, scorer).retrieve([request()])[0].ads == []
    apply_events(index, scorer, [upsert(1), upsert(2, targeting={"country": {"any_of": ["FR"]}})])
    response = Retriever(index, scorer).retrieve([request(country="US")])[0]
    assert [a.ad_id for a in response.ads] == [1] and response.eligible == 1


def test_warm_up_builds_the_cpu_kernel_even_for_an_empty_table_and_changes_nothing(small_schema, scorer):
    from kernels.cpu import library
    index = AdIndex(small_schema, scorer.dim)
    library.cache_clear()  # the next call loads (or builds) the library again
    Retriever(index, scorer).warm_up()
    assert library.cache_info().currsize == 1  # an empty table runs no pass: warm_up asked for the build itself
    apply_events(index, scorer, [upsert(1), upsert(2)])
    before = index.digest()
    Retriever(index, scorer).warm_up()
    assert index.digest() == before


def test_batch_requests_each_get_their_own_k_and_targeting(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i, targeting={"country": {"any_of": ["US" if i % 2 else "CA"]}}) for i in range(1, 21)])
    us, ca = Retriever(index, scorer).retrieve([request(k=3, country="US"), request(k=20, country="CA")])
    assert len(us.ads) == 3 and all(a.ad_id % 2 for a in us.ads)
    assert sorted(a.ad_id for a in ca.ads) == list(range(2, 21, 2))


def test_history_pulls_similar_ads_up(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(1, title="trail running shoes"), upsert(2, title="luxury watches gold"),
                                 upsert(3, title="running shoes for trail")])
    body = {"user": {"user_id": 1, "history": [{"ad_id": 1, "event": "click", "ts": 5}]}, "context": {"ts": 100}, "k": 2}
    top = Retriever(index, scorer).retrieve([parse_request(body)])[0].ads
    assert [a.ad_id for a in top] == [1, 3]


def test_empty_batch_and_a_bad_request_fail_alone(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(1), upsert(2)])
    retriever = Retriever(index, scorer)
    assert retriever.retrieve([]) == []
    good, bad, also_good = retriever.retrieve([request(k=1), request(shoe_size=3), request(k=2)])
    assert isinstance(bad, InvalidInput) and bad.field == "user.attributes.shoe_size"
    assert [a.ad_id for a in good.ads] == [1] and [a.ad_id for a in also_good.ads] == [1, 2]


@pytest.mark.parametrize("storage", ["fp16", "int8"])
def test_each_request_gets_the_answer_it_would_get_alone(small_schema, scorer, storage):
    """With rescoring, a request's shortlist must not grow with its batch mates' k."""
    index = AdIndex(small_schema, scorer.dim, embedding_dtype=STORAGE[storage])
    apply_events(index, scorer, [upsert(i, title=f"word{i % 42} shoes") for i in range(1, 60)])
    # To the scan ad 46 is ad 4 scaled down a little (ranked just below it, not tied: a tie would join the
    # shortlist); ad 46's exact vector scores 3x higher, so only a shortlist longer than one request's
    # rescore * k finds it.
    exact, stored = index.columns["embedding_exact"], index.columns["embedding"]
    exact[index.slot_of(46)] = 3 * exact[index.slot_of(4)]
    stored[index.slot_of(46)] = stored[index.slot_of(4)]
    if storage == "int8":
        index.columns["embedding_scale"][index.slot_of(46)] = 0.9 * index.columns["embedding_scale"][index.slot_of(4)]
    else:
        stored[index.slot_of(46)] *= 0.9
    retriever = Retriever(index, scorer, rescore=1)
    body = {"user": {"user_id": 1, "history": [{"ad_id": 4, "event": "click", "ts": 5}]}, "context": {"ts": 100}}
    small, large = parse_request({**body, "k": 1}), parse_request({**body, "k": 25})
    alone = [retriever.retrieve([r])[0] for r in (small, large)]
    together = retriever.retrieve([small, large])
    assert [a.ad_id for a in alone[0].ads] == [4] and alone[1].ads[0].ad_id == 46
    assert [r.ads for r in together] == [r.ads for r in alone] and [r.eligible for r in together] == [59, 59]


def test_queries_concatenate_and_results_split_back(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i, targeting={"country": {"any_of": ["US" if i % 2 else "CA"]}}) for i in range(1, 9)])
    retriever = Retriever(index, scorer)
    reqs = [request(k=2, country="US"), request(k=3, country="CA"), request(k=1)]
    compiled = compile_requests(small_schema, reqs)
    queries = [UserQuery(retriever.encode([r], [c.now]), [c.values], [c.now], [r.k]) for r, c in zip(reqs, compiled)]
    merged = split_topk(retriever.search(concat_queries(queries)), [len(q) for q in queries])
    for query, got in zip(queries, merged):
        alone = retriever.search(query)
        assert torch.equal(got.ids[:, : query.k[0]], alone.ids[:, : query.k[0]]) and torch.equal(got.eligible, alone.eligible)
    assert [a.ad_id for a in merged[0].row(0, 2)] == [1, 3] and merged[2].row(0, 1) == []


def test_a_tie_at_the_shortlist_cut_joins_the_shortlist(small_schema, scorer):
    """Ads the pass cannot tell apart are all rescored, whatever their slots: the result does not depend on
    which of them the table happens to hold first."""
    index = AdIndex(small_schema, scorer.dim, embedding_dtype=torch.float16)
    apply_events(index, scorer, [upsert(i, title=f"word{i % 42} shoes") for i in range(1, 60)])
    twins = [46, 20, 33]  # slot order differs from id order
    for twin in twins:
        index.columns["embedding"][index.slot_of(twin)] = index.columns["embedding"][index.slot_of(4)]
    index.columns["embedding_exact"][index.slot_of(33)] *= 3  # only the exact copy tells 33 apart
    body = {"user": {"user_id": 1, "history": [{"ad_id": 4, "event": "click", "ts": 5}]}, "context": {"ts": 100}, "k": 1}
    assert [a.ad_id for a in Retriever(index, scorer, rescore=1).retrieve([parse_request(body)])[0].ads] == [33]


def test_a_tie_over_the_whole_table_grows_the_pass_by_at_most_ties_kept(small_schema, scorer, monkeypatch):
    """Every ad scores the same for a user the scorer knows nothing of: the pass grows while the tie runs past its
    end, but by at most TIES_KEPT places (then the kernel's slot order cuts the tie), not to the whole table for
    every request of its batch."""
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i, title="same words") for i in range(1, 301)])
    widths, scan = [], retriever_module.dispatch.fused_scan
    monkeypatch.setattr(retriever_module, "TIES_KEPT", 10)
    monkeypatch.setattr(retriever_module.dispatch, "fused_scan", lambda *args: (widths.append(args[-1]), scan(*args))[1])
    [answer] = Retriever(index, scorer, rescore=1).retrieve([request(k=4)])
    assert widths == [5, 15] and len(answer.ads) == 4 and len({a.score for a in answer.ads}) == 1


def test_infinite_scores_go_out_as_float32_extremes_json_can_carry():
    top = TopK(torch.tensor([[7, 8, 9, -1]]), torch.tensor([[float("inf"), 1.5, float("-inf"), float("-inf")]]),
               torch.tensor([3]))
    row = top.row(0, 4)
    assert [(a.ad_id, a.score) for a in row] == [(7, FLOAT32_MAX), (8, 1.5), (9, -FLOAT32_MAX)]
    assert json.loads(RetrieveResponse(ads=row, eligible=3, took_ms=0.0).model_dump_json())["ads"][0]["score"] == FLOAT32_MAX
