from __future__ import annotations

import json

import numpy as np
import pytest

from andromeda_core.ingest import load_events, read_events
from andromeda_core.index import AdIndex
from andromeda_core.retriever import Retriever
from andromeda_core import synth
from andromeda_core.errors import InvalidInput
from andromeda_core.synth import (WorldConfig, engagement_probability, is_current, synthesize, truth_scores,
                                  world_config)
from andromeda_core.types import parse_request


@pytest.fixture(scope="module")
def world(tmp_path_factory, default_schema):
    out = tmp_path_factory.mktemp("world")
    return synthesize(WorldConfig(ads=3000, users=40, seed=3, chunk=700), out, default_schema, workers=2, progress=False)


def test_same_seed_same_world(world, tmp_path, default_schema):
    again = synthesize(WorldConfig(ads=3000, users=40, seed=3, chunk=700), tmp_path, default_schema, workers=1, progress=False)
    for name in ("events.jsonl", "requests.jsonl", "engagements.jsonl"):
        assert (world / name).read_bytes() == (again / name).read_bytes()
    other = synthesize(WorldConfig(ads=3000, users=40, seed=4, chunk=700), tmp_path / "o", default_schema, workers=1, progress=False)
    assert (world / "events.jsonl").read_bytes() != (other / "events.jsonl").read_bytes()


def test_world_is_valid_and_varied(world, default_schema, scorer):
    events = [e for batch in read_events(world / "events.jsonl") for e in batch]
    upserts = [e.ad for e in events if e.op == "upsert"]
    ops = {e.op for e in events}
    assert ops == {"upsert", "pause", "delete"} and len({a.ad_id for a in upserts}) == 3000
    targeted = [a.targeting for a in upserts]
    assert any("all_of" in r for t in targeted for r in t.values())
    assert any("none_of" in r for t in targeted for r in t.values())
    assert sum(not t for t in targeted) > 50 and sum(len(t) >= 3 for t in targeted) > 50  # broad and narrow
    assert any(a.status == "paused" for a in upserts) and any(a.end_time for a in upserts)
    index = AdIndex(default_schema, scorer.dim)
    load_events(index, default_schema, scorer, read_events(world / "events.jsonl"))
    requests = [parse_request(line) for line in (world / "requests.jsonl").read_text().splitlines()]
    responses = Retriever(index, scorer).retrieve(requests[:8])
    assert all(0 < r.eligible < len(index) and len(r.ads) == 100 for r in responses)


def test_engagement_follows_the_truth(world):
    truth = np.load(world / "truth.npz")
    log = [json.loads(line) for line in (world / "engagements.jsonl").read_text().splitlines()]
    clicked = {True: [], False: []}
    for e in log:
        score = truth_scores(truth["user_latent"][e["user_id"] - 1], truth["ad_latent"][[e["ad_id"] - 1]],
                             truth["ad_quality"][[e["ad_id"] - 1]])[0]
        clicked[e["event"] == "click"].append(score)
    assert np.mean(clicked[True]) > np.mean(clicked[False]) + 0.5


def test_engagement_probability_predicts_the_worlds_clicks(world):
    """Clicks on ads of the user's topics and on the others, summed over users, against the sums of the
    probabilities (independent Bernoulli draws: within 4 standard deviations)."""
    truth = np.load(world / "truth.npz")
    users = len(truth["user_latent"])
    observed, expected, variance = np.zeros(2), np.zeros(2), np.zeros(2)
    for e in map(json.loads, (world / "engagements.jsonl").read_text().splitlines()):
        if e["event"] == "click":
            observed[int(truth["ad_topic"][e["ad_id"] - 1] not in truth["user_topic"][e["user_id"] - 1])] += 1
    for u in range(users):
        p = engagement_probability(truth["user_latent"][u], truth["user_topic"][u], truth["ad_latent"],
                                   truth["ad_quality"], truth["ad_topic"])
        in_topic = np.isin(truth["ad_topic"], truth["user_topic"][u])
        for part, mask in enumerate((in_topic, ~in_topic)):
            expected[part] += p[mask].sum()
            variance[part] += (p * (1 - p))[mask].sum()
    assert observed.min() > 0
    assert (np.abs(observed - expected) < 4 * np.sqrt(variance)).all(), (observed, expected, np.sqrt(variance))


def test_a_users_last_click_is_drawn_like_any_other(world):
    """The last click of each history (the report's held-out engagement) lands on the user's topics as often as
    the engagement probability's odds, over the ads not clicked before it, say (within 4 standard deviations): the
    order of the log does not tell how an ad came to be shown."""
    truth = np.load(world / "truth.npz")
    observed = expected = variance = 0.0
    for line in (world / "requests.jsonl").read_text().splitlines():
        user = json.loads(line)["user"]
        clicks = [h["ad_id"] - 1 for h in user["history"]]
        if not clicks:
            continue
        u = user["user_id"] - 1
        p = engagement_probability(truth["user_latent"][u], truth["user_topic"][u], truth["ad_latent"],
                                   truth["ad_quality"], truth["ad_topic"])
        odds = p / (1 - p)  # given the other clicks, the last is ad a with probability proportional to its odds
        odds[clicks[:-1]] = 0
        share = odds[np.isin(truth["ad_topic"], truth["user_topic"][u])].sum() / odds.sum()
        observed += truth["ad_topic"][clicks[-1]] in truth["user_topic"][u]
        expected += share
        variance += share * (1 - share)
    assert abs(observed - expected) < 4 * np.sqrt(variance), (observed, expected, np.sqrt(variance))


def test_a_world_of_an_older_generator_is_not_current(world, tmp_path):
    assert is_current(world) and not is_current(tmp_path)
    with np.load(world / "truth.npz") as arrays:
        np.savez(tmp_path / "truth.npz", **{k: arrays[k] for k in arrays.files if k != "generator"})
    assert not is_current(tmp_path)


def test_a_world_written_over_is_no_world_until_complete(tmp_path, default_schema, monkeypatch):
    """synth stopped part way over an existing world (Ctrl-C) left the old truth.npz beside empty files: demo, train
    and eval took it for that world; and files cut short, which `retrieve` read without a word. Each file is now
    written whole under a temporary name and renamed at the end: the old ones stay whole until then."""
    small = WorldConfig(ads=30, users=2, seed=1)
    synthesize(small, tmp_path, default_schema, workers=1, progress=False)
    assert world_config(tmp_path) == small
    before = {name: (tmp_path / name).read_bytes() for name in ("events.jsonl", "requests.jsonl", "engagements.jsonl")}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "_user", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthesize(WorldConfig(ads=40, users=2, seed=2), tmp_path, default_schema, workers=1, progress=False)
    assert world_config(tmp_path) is None and not is_current(tmp_path)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_a_truth_file_that_synth_did_not_write_is_named(tmp_path):
    for content in (b"\x93NUMPY garbage" * 20, b""):  # an empty file raised EOFError
        (tmp_path / "truth.npz").write_bytes(content)
        for read in (world_config, is_current):
            with pytest.raises(InvalidInput) as error:
                read(tmp_path)
            assert error.value.field == str(tmp_path / "truth.npz") and "not a world written by" in error.value.message
