from __future__ import annotations

from andromeda_core.index import AdIndex
from andromeda_core.retriever import Retriever
from andromeda_core.types import parse_request
from tests.conftest import apply_events, upsert


def request(k: int = 10, **attributes) -> object:
    return parse_request({"user": {"user_id": 1, "attributes": attributes}, "context": {"ts": 100}, "k": k})


def test_ties_break_by_ad_id_whatever_the_slot_order(small_schema, scorer):
    events = [upsert(i, title="same words") for i in (50, 7, 31, 2, 99, 13)]
    forward, backward = AdIndex(small_schema, scorer.dim, 2), AdIndex(small_schema, scorer.dim, 2)
    apply_events(forward, scorer, events)
    apply_events(backward, scorer, events[::-1])
    got = [[a.ad_id for a in Retriever(ix, scorer, chunk_size=4).retrieve([request(k=4)])[0].ads] for ix in (forward, backward)]
    assert got == [[2, 7, 13, 31]] * 2


def test_fewer_eligible_than_k_and_empty_index(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    assert Retriever(index, scorer).retrieve([request()])[0].ads == []
    apply_events(index, scorer, [upsert(1), upsert(2, targeting={"country": {"any_of": ["FR"]}})])
    response = Retriever(index, scorer).retrieve([request(country="US")])[0]
    assert [a.ad_id for a in response.ads] == [1] and response.eligible == 1


def test_batch_requests_each_get_their_own_k_and_targeting(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i, targeting={"country": {"any_of": ["US" if i % 2 else "CA"]}}) for i in range(1, 21)])
    us, ca = Retriever(index, scorer, chunk_size=3).retrieve([request(k=3, country="US"), request(k=20, country="CA")])
    assert len(us.ads) == 3 and all(a.ad_id % 2 for a in us.ads)
    assert sorted(a.ad_id for a in ca.ads) == list(range(2, 21, 2))


def test_history_pulls_similar_ads_up(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(1, title="trail running shoes"), upsert(2, title="luxury watches gold"),
                                 upsert(3, title="running shoes for trail")])
    body = {"user": {"user_id": 1, "history": [{"ad_id": 1, "event": "click", "ts": 5}]}, "context": {"ts": 100}, "k": 2}
    top = Retriever(index, scorer).retrieve([parse_request(body)])[0].ads
    assert [a.ad_id for a in top] == [1, 3]
