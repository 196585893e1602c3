"""Property tests: the compiled index reproduces the naive contract evaluator bit for bit."""
from __future__ import annotations

import itertools
from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_core.index import AdIndex
from andromeda_core.retriever import Retriever, exact_scores
from andromeda_core.targeting import compile_targeting, compile_user
from andromeda_core.types import parse_request
from tests.conftest import SMALL_SCHEMA, apply_events, upsert
from tests.naive import naive_eligible

CATS = {c["name"]: c for c in SMALL_SCHEMA["categories"]}
NOW = 1000


def domain(name: str) -> list:
    """The values rules and users draw from: a small part of each vocabulary, so ads and users collide often."""
    cat = CATS[name]
    if cat["kind"] == "enum":
        # Three values from the first bitset word, two from the last, for multi-word bitsets.
        return cat["vocabulary"][:3] + cat["vocabulary"][-2:]
    if cat["kind"] == "ordinal":
        return list(range(cat["range"][0], cat["range"][1] + 1))
    return list(range(5))


def values_of(name: str) -> st.SearchStrategy:
    return st.sampled_from(domain(name))


def value_lists(name: str, max_size: int) -> st.SearchStrategy:
    return st.lists(values_of(name), min_size=1, max_size=max_size)


@st.composite
def rules(draw, name: str) -> dict:
    cat = CATS[name]
    limit = cat.get("max_values", 6)  # only list-encoded categories of SMALL_SCHEMA set max_values
    groups_allowed = cat.get("max_groups", 2 if cat.get("multi") else 1)
    rule: dict = {}
    if draw(st.booleans()):
        rule["any_of"] = draw(value_lists(name, limit))
    if cat.get("multi") and draw(st.booleans()):
        rule["all_of"] = draw(st.lists(value_lists(name, limit), min_size=1, max_size=groups_allowed - len(rule)))
    elif not cat.get("multi") and draw(st.booleans()):
        rule["all_of"] = draw(st.lists(value_lists(name, limit), min_size=1, max_size=3))
    if cat["kind"] == "ordinal" and draw(st.booleans()):
        lo = draw(st.integers(13, 20))
        rule.update({k: v for k, v in (("min", lo), ("max", draw(st.integers(lo, 20)))) if draw(st.booleans())})
    if draw(st.booleans()) or not rule:
        rule["none_of"] = draw(st.lists(values_of(name), max_size=limit))
    return rule


@st.composite
def ads(draw, ad_id: int) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(CATS)), unique=True, max_size=4))
    targeting = {n: draw(rules(n)) for n in names}
    fields = {}
    if draw(st.booleans()):
        fields["status"] = draw(st.sampled_from(["active", "paused"]))
    start = draw(st.none() | st.integers(NOW - 3, NOW + 3))
    end = draw(st.none() | st.integers(NOW - 3, NOW + 3))
    if start is not None and end is not None and start >= end:
        start, end = end - 1, start + 1
    fields.update({k: v for k, v in (("start_time", start), ("end_time", end)) if v is not None})
    return upsert(ad_id, targeting=targeting, **fields)["ad"]


def unknown_value(name: str) -> str | int:
    """A well-typed value outside the category's vocabulary or range (it matches nothing)."""
    cat = CATS[name]
    return "unknown-value" if cat["kind"] == "enum" else cat.get("cardinality", 10**6) + 7


def user_value(name: str) -> st.SearchStrategy:
    """What a user holds in one category: nothing, one value, or (multi) a list with unknown values."""
    if CATS[name].get("multi"):
        return st.lists(values_of(name) | st.just(unknown_value(name)), max_size=4)
    return st.none() | values_of(name)


@st.composite
def users(draw) -> tuple[dict, dict]:
    attributes = {name: draw(user_value(name)) for name in CATS if CATS[name].get("source") != "context"}
    context = {"surface": draw(user_value("surface"))}
    return ({k: v for k, v in attributes.items() if v is not None}, {k: v for k, v in context.items() if v is not None})


def _drop_unknown(attributes: dict) -> dict:
    return {k: [x for x in v if x != unknown_value(k)] if isinstance(v, list) else v for k, v in attributes.items()}


def _eligible_ids(schema, index, user_list, now) -> list[list[int]]:
    compiled = [compile_user(schema, a, c)[0] for a, c in user_list]
    return index.eligible(compiled, [now] * len(user_list))


@pytest.mark.parametrize("name", sorted(CATS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_rule_kind_of_every_category(small_schema, scorer, name, data):
    """One category at a time, dense collisions: any_of, all_of, min/max, none_of and their mixes."""
    rule_list = data.draw(st.lists(rules(name), min_size=1, max_size=6))
    ad_list = [upsert(i + 1, targeting={name: rule})["ad"] for i, rule in enumerate(rule_list)]
    index = AdIndex(small_schema, scorer.dim, capacity=2)
    apply_events(index, scorer, [{"op": "upsert", "ad": ad} for ad in ad_list])
    held = data.draw(user_value(name))
    source = CATS[name].get("source", "user")
    user = ({name: held} if source == "user" and held is not None else {},
            {name: held} if source == "context" and held is not None else {})
    want = [ad["ad_id"] for ad in ad_list if naive_eligible(small_schema, ad, _drop_unknown(user[0]), user[1], NOW)]
    assert _eligible_ids(small_schema, index, [user], NOW) == [want]


def every_user(name: str) -> Iterator[tuple[dict, dict]]:
    """(attributes, context) of every user the rules of `name` can tell apart: each value of its domain held alone
    (single-valued) or every set of them (multi-valued), and none."""
    values = domain(name)
    held = ([list(c) for r in range(1, len(values) + 1) for c in itertools.combinations(values, r)]
            if CATS[name].get("multi") else values)
    for h in [None, *held]:
        user = {} if h is None else {name: h}
        yield (user, {}) if CATS[name].get("source") != "context" else ({}, user)


@pytest.mark.parametrize("name", sorted(CATS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_ad_is_satisfiable_iff_some_user_may_be_served_it(small_schema, name, data):
    """GET /v1/ads's `satisfiable` (and the scan's status bit): False exactly when no user at all matches."""
    rule = data.draw(rules(name))
    ad = upsert(1, targeting={name: rule})["ad"]
    some = any(naive_eligible(small_schema, ad, attributes, context, NOW) for attributes, context in every_user(name))
    assert compile_targeting(small_schema, {name: rule}).satisfiable == some, rule


@pytest.mark.parametrize("refs_width", [2, 6])  # 2: most ads keep one ref and a compound of the rest
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=8, unique=True).flatmap(
    lambda ids: st.tuples(*(ads(i) for i in ids))), st.lists(users(), min_size=1, max_size=4),
    st.integers(NOW - 4, NOW + 4))
def test_index_matches_naive_evaluator(small_schema, scorer, refs_width, ad_list, user_list, now):
    # Ids in the index of ids, users in the index of users: every pair is checked.
    index = AdIndex(small_schema, scorer.dim, capacity=3, refs_width=refs_width)
    assert all(apply_events(index, scorer, [{"op": "upsert", "ad": ad} for ad in ad_list]))
    got = _eligible_ids(small_schema, index, user_list, now)
    for (attributes, context), eligible in zip(user_list, got):
        want = sorted(ad["ad_id"] for ad in ad_list
                      if naive_eligible(small_schema, ad, _drop_unknown(attributes), context, now))
        assert eligible == want


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=10, unique=True).flatmap(
    lambda ids: st.tuples(*(ads(i) for i in ids))), users(), st.integers(1, 12))
def test_retrieve_returns_best_eligible_in_order(small_schema, scorer, ad_list, user, k):
    index = AdIndex(small_schema, scorer.dim, capacity=2)
    apply_events(index, scorer, [{"op": "upsert", "ad": ad} for ad in ad_list])
    attributes, context = user
    request = parse_request({"user": {"user_id": 1, "attributes": attributes}, "context": {**context, "ts": NOW}, "k": k})
    response = Retriever(index, scorer).retrieve([request])[0]
    eligible = {ad["ad_id"] for ad in ad_list if naive_eligible(small_schema, ad, _drop_unknown(attributes), context, NOW)}
    assert response.eligible == len(eligible)
    got = [(a.ad_id, a.score) for a in response.ads]
    assert len(got) == min(k, len(eligible))
    assert {i for i, _ in got} <= eligible
    assert got == sorted(got, key=lambda p: (-p[1], p[0]))
    # Nothing left out scores better than the worst returned ad.
    if got:
        users = scorer.encode_users([request], index.embeddings_of, [NOW])
        def alone(ad_id: int) -> float:  # each ad scored alone, as the retriever rescores
            vector, found = index.embeddings_of([ad_id], NOW)  # at the request's time (an ad may end after it)
            assert found.all()
            return exact_scores(scorer, users, vector[None], torch.ones((1, 1), dtype=torch.bool))[0, 0].item()

        emb = {i: alone(i) for i in eligible}
        worst = got[-1]
        assert all((-s, i) >= (-worst[1], worst[0]) for i, s in emb.items() if i not in {g[0] for g in got})


@st.composite
def churn(draw) -> list[dict]:
    """Upserts (new targeting each time), deletes and pauses of a few ads, versions increasing."""
    events = []
    for version in range(1, draw(st.integers(1, 25)) + 1):
        ad_id, op = draw(st.integers(1, 4)), draw(st.sampled_from(["upsert", "upsert", "delete", "pause"]))
        if op == "upsert":
            ad = draw(ads(ad_id))
            events.append({"op": "upsert", "ad": {**ad, "version": version}})
        else:
            events.append({"op": op, "ad_id": ad_id, "version": version})
    return events


@pytest.mark.parametrize("refs_width", [2, 6])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(churn(), st.lists(users(), min_size=1, max_size=3))
def test_clauses_follow_updates_and_snapshots(small_schema, scorer, refs_width, events, user_list):
    """After any churn the dictionary holds exactly the clauses live ads refer to (recycled ids included),
    the index still equals the naive evaluator over its live ads, and a state round trip keeps both."""
    index = AdIndex(small_schema, scorer.dim, capacity=2, refs_width=refs_width)
    for event in events:  # one batch per event: rows are overwritten and freed across batches
        apply_events(index, scorer, [event])
    live = {}
    for event in events:
        ad_id = event["ad"]["ad_id"] if event["op"] == "upsert" else event["ad_id"]
        if event["op"] == "upsert":
            live[ad_id] = dict(event["ad"])
        elif event["op"] == "delete":
            live.pop(ad_id, None)
        elif ad_id in live:
            live[ad_id]["status"] = "paused"
    restored = AdIndex.from_state(small_schema, *index.export_state())
    assert restored.digest() == index.digest() and len(restored.clauses) == len(index.clauses)
    for target in (index, restored):
        got = _eligible_ids(small_schema, target, user_list, NOW)
        for (attributes, context), eligible in zip(user_list, got):
            assert eligible == sorted(i for i, ad in live.items()
                                      if naive_eligible(small_schema, ad, _drop_unknown(attributes), context, NOW))
        apply_events(target, scorer, [{"op": "delete", "ad_id": i, "version": 100} for i in live])
        assert len(target.clauses) == 0  # nothing leaked: every reference was dropped with its row
