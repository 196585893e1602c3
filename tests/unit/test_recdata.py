"""Data loaders for training: MovieLens protocol (time order, held-out last items) and the synthetic world."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from andromeda_core.config import load_settings
from andromeda_core.models.recdata import EVENTS, load_movielens, load_synthetic
from andromeda_core.synth import WorldConfig, synthesize


@pytest.fixture(scope="module")
def small_movielens(tmp_path_factory):
    """The real files cut down to 150 movies and the ratings of them."""
    src, out = load_settings().movielens_dir, tmp_path_factory.mktemp("ml")
    with open(src / "movies.csv", encoding="utf-8") as f:
        movies = list(csv.reader(f))[:151]
    keep = {row[0] for row in movies[1:]}
    with open(src / "ratings.csv", encoding="utf-8") as f:
        ratings = [row for i, row in enumerate(csv.reader(f)) if i == 0 or row[1] in keep]
    for name, rows in (("movies.csv", movies), ("ratings.csv", ratings)):
        with open(out / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
    return out, ratings[1:]


def test_movielens_sequences_follow_time_and_split_last_two(small_movielens):
    directory, ratings = small_movielens
    data = load_movielens(directory)
    assert len(data.items.ids) == 150 and data.items.text.shape == (150, 384)
    user = data.eval_users()[0]
    seq, times = data.users.items[user], data.users.times[user]
    assert (np.diff(times) >= 0).all()
    val, test = data.split(user)
    assert (val, test) == (len(seq) - 2, len(seq) - 1)
    examples = data.train_examples()
    assert examples[:, 1].min() == 1 and all(p < len(data.users.items[u]) - 2 for u, p in examples)
    liked = {EVENTS.index("like"), EVENTS.index("click")}
    assert set(np.concatenate(data.users.events).tolist()) <= liked
    assert sum(len(s) for s in data.users.items) == len(ratings)


def test_synthetic_loader_keeps_latest_versions_and_clicks(tmp_path, default_schema):
    world = synthesize(WorldConfig(ads=600, users=30, seed=2), tmp_path, default_schema, workers=1, progress=False)
    data = load_synthetic(world)
    assert len(data.items.ids) == 600 and data.truth["ad_latent"].shape[0] == 600
    first = json.loads((world / "requests.jsonl").read_text().splitlines()[0])
    clicks = [h["ad_id"] for h in first["user"]["history"]]
    assert data.items.ids[data.users.items[0]].tolist() == clicks
    assert data.users.context[0, 0] == default_schema.by_name["surface"].value_index(first["context"]["surface"]) + 1


def test_synthetic_impressions_are_the_logged_ones_before_the_held_out_engagements(tmp_path, default_schema):
    world = synthesize(WorldConfig(ads=600, users=30, seed=2), tmp_path, default_schema, workers=1, progress=False)
    data = load_synthetic(world)
    log = [json.loads(line) for line in (world / "engagements.jsonl").read_text().splitlines()]
    row = {int(ad_id): r for r, ad_id in enumerate(data.items.ids)}
    for u in range(len(data.users.items)):
        times = data.users.times[u]
        held_out = times[max(len(times) - 2, 0)] if len(times) else np.inf
        expected = [(row[e["ad_id"]], int(e["event"] == "click"), int((times < e["ts"]).sum()))
                    for e in log if e["user_id"] == u + 1 and e["ts"] < held_out]
        assert data.users.shown[u].tolist() == [list(x) for x in expected]
        clicked_times = {e["ts"] for e in log if e["user_id"] == u + 1 and e["event"] == "click"}
        assert set(times[-2:].tolist()) <= clicked_times  # the held-out engagements are clicks of the log, left out
    shown = data.train_impressions()
    assert shown.shape[1] == 4 and 0 < shown[:, 3].mean() < 1
    assert all(p <= max(data.split(u)[0], 0) for u, p in shown[:, :2])  # no engagement held out is in a history


def test_click_logodds_smooths_each_items_click_rate_toward_the_overall_one(tmp_path, default_schema):
    data = load_synthetic(synthesize(WorldConfig(ads=600, users=30, seed=2), tmp_path, default_schema, workers=1,
                                     progress=False))
    shown = data.train_impressions()
    rate = shown[:, 3].mean()
    item = int(np.bincount(shown[:, 2]).argmax())  # the item shown most often
    seen, clicked = (shown[:, 2] == item).sum(), shown[shown[:, 2] == item, 3].sum()
    by_hand = np.log((clicked + 2 * rate) / (seen - clicked + 2 * (1 - rate))) - np.log(rate / (1 - rate))
    logodds = data.click_logodds(smoothing=2.0)
    assert logodds[item] == pytest.approx(by_hand, rel=1e-5)
    never = np.setdiff1d(np.arange(len(data.items.ids)), shown[:, 2])
    assert len(never) and not logodds[never].any()
    data.users.shown = []  # data that logs no impressions (MovieLens): every item 0
    assert not data.click_logodds().any()
