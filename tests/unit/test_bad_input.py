"""Malformed events, targeting and requests: a clear error naming the field, and no change."""
from __future__ import annotations

import codecs
import json

import pytest

from andromeda_cli.request_file import read_text
from andromeda_core.errors import InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops, read_events
from andromeda_core.schema import schema_from_dict
from andromeda_core.targeting import compile_targeting, compile_user
from andromeda_core.types import parse_event, parse_request
from tests.conftest import SMALL_SCHEMA, apply_events, make_ad, upsert


@pytest.mark.parametrize("event, field, words", [
    ({"op": "upsert", "ad": {**make_ad(1), "ad_id": "1"}}, "ad.ad_id", "integer"),
    ({"op": "upsert", "ad": {**make_ad(1), "bid": -1}}, "ad.bid", "greater than or equal"),
    ({"op": "upsert", "ad": {**make_ad(1), "bid": "cheap"}}, "ad.bid", "number"),
    ({"op": "upsert", "ad": {**make_ad(1), "bid": 3.5e38}}, "ad.bid", "less than or equal"),
    ({"op": "upsert", "ad": {**make_ad(1), "bid": 1e-50}}, "ad.bid", "must be 0 or at least 1.1754943508222875e-38"),
    ({"op": "upsert", "ad": {**make_ad(1), "bid": 1e-40}}, "ad.bid", "(bids are stored as float32)"),
    ({"op": "upsert", "ad": {**make_ad(1), "status": "running"}}, "ad.status", "active"),
    ({"op": "upsert", "ad": {**make_ad(1), "start_time": 9, "end_time": 3}}, "ad.end_time", "must be after start_time (9)"),
    ({"op": "upsert", "ad": {**make_ad(1), "start_time": 9, "end_time": 9}}, "ad.end_time", "must be after start_time (9)"),
    ({"op": "upsert", "ad": {**make_ad(1), "colour": "red"}}, "ad.colour", "Extra"),
    ({"op": "upsert", "ad": {k: v for k, v in make_ad(1).items() if k != "creative"}}, "ad.creative", "required"),
    ({"op": "delete", "ad_id": 1}, "version", "required"),
    ({"op": "pause", "ad_id": -5, "version": 1}, "ad_id", "greater than or equal"),
    ({"op": "explode", "ad_id": 1, "version": 1}, "op", "explode"),
    ("{not json", "", "not JSON"),  # the line itself
    ('{"op": "pause", "ad_id": 1, "version": 1, "version": 2}', "", 'key "version" appears twice'),
    ('{"op": "pause", "ad_id": 1, "version": NaN}', "", "NaN is not a JSON number"),
    (b'{"op": "pause", "ad_id": 1, "version": 1, "note": "\xff"}', "", "not UTF-8"),
    # a positive bid below float64's range read as 0 (until 2026-12-07 it was stored so, where 1e-50 is refused)
    ('{"op": "upsert", "ad": {"bid": 1e-400}}', "", "the number 1e-400 at ad.bid is too small for a float64"),
    ("[1]", "", "Input should be an object"),  # the whole event: the line, not a field "body" that is not there
    ({"op": "upsert", "ad": {**make_ad(1), "bid": float("nan")}}, "ad.bid", "nan is not a JSON number"),  # Python
    ({"op": "upsert", "ad": {**make_ad(1), "targeting": {"age": {"min": float("inf")}}}}, "ad.targeting.age.min",
     "inf is not a JSON number"),  # callers' dicts: the field, not the event
])
def test_malformed_events_name_the_field(event, field, words):
    with pytest.raises(InvalidInput) as err:
        parse_event(event, "events.jsonl:7")
    assert err.value.field == "events.jsonl:7" + (f".{field}" if field else "") and words in err.value.message


@pytest.mark.parametrize("targeting, field, words", [
    ({"colour": {"any_of": ["red"]}}, "t.colour", "unknown targeting category"),
    ({"country": {"any_of": ["US", "XX"]}}, "t.country.any_of[1]", "'XX'"),
    ({"country": {"any_of": []}}, "t.country.any_of", "at least one"),
    ({"country": {"any_of": "US"}}, "t.country.any_of", "list"),
    ({"country": {"sometimes": ["US"]}}, "t.country", "unknown rule keys"),
    ({"country": {}}, "t.country", "non-empty mapping"),
    ({"country": {"min": 1}}, "t.country", "ordinal"),
    ({"age": {"min": 18, "max": 15}}, "t.age", "greater than max"),
    ({"age": {"min": 5}}, "t.age.min", "[13, 20]"),
    ({"age": {"any_of": [True]}}, "t.age.any_of[0]", "True"),
    ({"interests": {"all_of": []}}, "t.interests.all_of", "non-empty"),
    ({"interests": {"all_of": [["i1"], ["i2"], ["i3"], ["i4"]]}}, "t.interests", "at most 3 positive groups"),
    ({"topics": {"any_of": ["t1", "t2", "t3", "t4", "t5"]}}, "t.topics.any_of", "at most 4 distinct values"),
    ({"audiences": {"none_of": [1, 2, 3, 4, 5]}}, "t.audiences.none_of", "at most 4"),
    ({"audiences": {"any_of": [50]}}, "t.audiences.any_of[0]", "[0, 50)"),
    ("everyone", "t", "mapping"),
])
def test_bad_targeting_names_category_and_value(small_schema, targeting, field, words):
    with pytest.raises(InvalidInput) as err:
        compile_targeting(small_schema, targeting, "t")
    assert err.value.field == field and words in err.value.message


def test_bad_ad_in_a_batch_changes_nothing_and_names_the_ad(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(1)])
    before = index.digest()
    events = [parse_event(upsert(2)), parse_event(upsert(3, targeting={"country": {"any_of": ["Atlantis"]}}))]
    with pytest.raises(InvalidInput) as err:
        index.apply(prepare_ops(small_schema, scorer, events))
    assert "ad 3" in str(err.value) and err.value.field == "ad.targeting.country.any_of[0]"
    assert index.digest() == before and 2 not in index


@pytest.mark.parametrize("request_body, field, words", [
    ({"user": {"user_id": 1}, "k": 0}, "k", "greater than or equal"),
    ({"user": {"user_id": 1}, "k": 10**6}, "k", "less than or equal"),
    ({"user": {"user_id": "x"}}, "user.user_id", "integer"),
    ({"user": {"user_id": 1, "history": [{"ad_id": 1, "event": "stare", "ts": 1}]}}, "user.history[0].event", "click"),
    ({"context": {"surface": "feed"}}, "user", "required"),
    ({"user": {"user_id": 1}, "context": {"ts": -1}}, "context.ts", "greater than or equal"),
])
def test_malformed_requests_name_the_field(request_body, field, words):
    with pytest.raises(InvalidInput) as err:
        parse_request(request_body)
    assert err.value.field == field and words in err.value.message


def test_request_unknown_category_is_an_error_unknown_value_a_warning(small_schema):
    with pytest.raises(InvalidInput) as err:
        compile_user(small_schema, {"shoe_size": 44}, {})
    assert err.value.field == "user.attributes.shoe_size"
    values, warnings = compile_user(small_schema, {"country": "Atlantis", "interests": ["i1", "nope"]}, {"surface": "feed"})
    assert values == {"interests": (1,), "surface": (0,)}
    assert warnings == ["user.attributes.country: unknown value 'Atlantis' matches nothing",
                        "user.attributes.interests[1]: unknown value 'nope' matches nothing"]


def test_null_for_a_known_category_is_leaving_it_out_and_unset_context_fields_are_not_sent(small_schema):
    assert compile_user(small_schema, {"country": None}, {"surface": None}) == ({}, [])
    context = parse_request({"user": {"user_id": 1}, "context": {"ts": 5}}).context
    assert context.targeting_values() == {}  # a schema without surface or placement still takes it


def test_a_multi_valued_category_takes_one_value_alone_as_a_list_of_one(small_schema):
    assert compile_user(small_schema, {"interests": "i1"}, {}) == compile_user(small_schema, {"interests": ["i1"]}, {})
    assert compile_user(small_schema, {"interests": "i1"}, {})[0] == {"interests": (1,)}
    values, warnings = compile_user(small_schema, {"interests": "nope"}, {})
    assert values == {} and warnings == ["user.attributes.interests: unknown value 'nope' matches nothing"]


@pytest.mark.parametrize("attributes, context, field, words", [
    ({"country": ["US", "CA"]}, {}, "user.attributes.country", "one value"),
    ({"surface": "feed"}, {}, "user.attributes.surface", "context"),
    ({}, {"country": "US"}, "context.country", "user.attributes"),
    ({"interests": [{"a": 1}]}, {}, "user.attributes.interests[0]", "values are strings"),
    ({"interests": ["i1", 2]}, {}, "user.attributes.interests[1]", "values are strings"),
    ({"age": "30"}, {}, "user.attributes.age", "values are integers"),
    ({"age": [15]}, {}, "user.attributes.age", "one value"),
    ({"audiences": ["a1"]}, {}, "user.attributes.audiences[0]", "values are integers"),
    ({}, {"weather": "rain"}, "context.weather", "unknown targeting category"),
    ({"shoe_size": None}, {}, "user.attributes.shoe_size", "unknown targeting category"),  # null is no way around it
    ({}, {"weather": None}, "context.weather", "unknown targeting category"),
])
def test_bad_request_values_name_the_field(small_schema, attributes, context, field, words):
    with pytest.raises(InvalidInput) as err:
        compile_user(small_schema, attributes, context)
    assert err.value.field == field and words in err.value.message


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s["categories"].append({"name": "x", "kind": "colour"}), "categories.x.kind"),
    (lambda s: s["categories"].append({"name": "x", "kind": "enum", "vocabulary": []}), "categories.x.vocabulary"),
    (lambda s: s["categories"].append({"name": "x", "kind": "ordinal", "range": [0, 1000]}), "categories.x.range"),
    (lambda s: s["categories"].append({"name": "x", "kind": "id"}), "categories.x.cardinality"),
    (lambda s: s["categories"].append(dict(s["categories"][0])), "categories"),
    (lambda s: s["categories"].append({"name": "ts", "kind": "ordinal", "range": [0, 5], "source": "context"}),
     "categories.ts.name"),  # context.ts is the request's time: such a category could never match
    (lambda s: s.update(verison=2), "verison"),  # a typo is refused, not ignored
])
def test_bad_schema_names_the_field(mutate, field):
    raw = {**SMALL_SCHEMA, "categories": [dict(c) for c in SMALL_SCHEMA["categories"]]}
    mutate(raw)
    with pytest.raises(InvalidInput) as err:
        schema_from_dict(raw)
    assert err.value.field == field


def test_a_bid_of_minus_zero_is_stored_as_zero():
    """ge=0 lets -0.0 through: the one bid whose stored form was not '0 or positive'."""
    bid = parse_event({"op": "upsert", "ad": {**make_ad(1), "bid": -0.0}}).ad.bid
    assert bid == 0.0 and str(bid) == "0.0"


def test_files_may_start_with_a_byte_order_mark_as_http_bodies_may(tmp_path):
    """An editor's "UTF-8 with BOM": refused at line 1 until 2026-12-07, while the service ignored it in a body."""
    events, request = tmp_path / "events.jsonl", tmp_path / "request.json"
    events.write_bytes(codecs.BOM_UTF8 + "".join(json.dumps(upsert(i)) + "\n" for i in (1, 2)).encode())
    request.write_bytes(codecs.BOM_UTF8 + b'{"user": {"user_id": 1}}')
    assert [e.ad.ad_id for batch in read_events(events) for e in batch] == [1, 2]
    assert json.loads(read_text(request)) == {"user": {"user_id": 1}}
    request.write_bytes(codecs.BOM_UTF8 + b'{"user": {"user_id": 1, "c": "\xff"}}')
    with pytest.raises(InvalidInput, match=r"not UTF-8 text \(byte 33\)"):  # counted from the file's start
        read_text(request)


def test_context_categories_named_surface_or_placement_take_what_the_schema_says(scorer):
    """`surface` and `placement` were typed as one string on the wire: a schema declaring them multi-valued or of ids
    could not be targeted by any request (422), though its ads were indexed."""
    schema = schema_from_dict({**SMALL_SCHEMA, "categories": [
        *[c for c in SMALL_SCHEMA["categories"] if c["name"] != "surface"],
        {"name": "surface", "kind": "enum", "multi": True, "source": "context", "vocabulary": ["feed", "reels"]},
        {"name": "placement", "kind": "id", "source": "context", "cardinality": 10}]})
    index = AdIndex(schema, scorer.dim)
    apply_events(index, scorer, [upsert(1, targeting={"surface": {"any_of": ["reels"]}, "placement": {"any_of": [7]}}),
                                 upsert(2, targeting={"placement": {"any_of": [3]}})])
    request = parse_request({"user": {"user_id": 1}, "context": {"surface": ["feed", "reels"], "placement": 7}})
    values, warnings = compile_user(schema, request.user.attributes, request.context.targeting_values())
    assert values == {"surface": (0, 1), "placement": (7,)} and not warnings
    assert index.eligible([values], [1000])[0] == [1]
    with pytest.raises(InvalidInput, match="surface values are strings") as refused:  # the shipped kind: one string
        compile_user(schema_from_dict(SMALL_SCHEMA), {}, parse_request(
            {"user": {"user_id": 1}, "context": {"surface": 5}}).context.targeting_values())
    assert refused.value.field == "context.surface"
