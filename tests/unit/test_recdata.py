"""Data loaders for training: MovieLens protocol (time order, held-out last items) and the synthetic world."""
from __future__ import annotations

import csv
import json
import zlib

import numpy as np
import pytest

from andromeda_core.config import load_settings
from andromeda_core.errors import InvalidInput
from andromeda_core.models import recdata
from andromeda_core.models.recdata import EVENTS, Items, RecData, Users, load_movielens, load_synthetic
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_cli.main import main


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


def test_movielens_ratings_of_one_second_are_in_hashed_order_not_by_movie(small_movielens):
    """Ratings of one user and second come in the order of crc32("user:movieId"), whatever the file's order."""
    directory, ratings = small_movielens
    data, seconds = load_movielens(directory), {}
    for user, movie, _, ts in ratings:
        seconds.setdefault((int(user), int(ts)), []).append(int(movie))
    tied = {key: movies for key, movies in seconds.items() if len(movies) > 1}
    assert len(tied) > 20
    users, in_movie_order = sorted({user for user, _ in seconds}), 0
    for (user, ts), movies in tied.items():
        u = users.index(user)
        got = data.items.ids[data.users.items[u][data.users.times[u] == ts]].tolist()
        assert got == sorted(movies, key=lambda m: zlib.crc32(f"{user}:{m}".encode()))
        in_movie_order += got == sorted(movies)
    assert in_movie_order < len(tied)


def test_synthetic_loader_keeps_latest_versions_and_clicks(tmp_path, default_schema):
    world = synthesize(WorldConfig(ads=600, users=30, seed=2), tmp_path, default_schema, workers=1, progress=False)
    data = load_synthetic(world)
    assert len(data.items.ids) == 600 and data.truth["ad_latent"].shape[0] == 600
    first = json.loads((world / "requests.jsonl").read_text().splitlines()[0])
    clicks = [h["ad_id"] for h in first["user"]["history"]]
    assert data.items.ids[data.users.items[0]].tolist() == clicks
    assert data.users.context[0, 0] == default_schema.by_name["surface"].value_index(first["context"]["surface"]) + 1
    assert data.users.interests[0] == first["user"]["attributes"]["interests"] and len(data.users.interests) == 30
    upserts = [e["ad"] for e in map(json.loads, (world / "events.jsonl").read_text().splitlines()) if e["op"] == "upsert"]
    ad = [a for a in upserts if a["ad_id"] == data.items.ids[0]][-1]
    assert data.items.texts[0] == f"{ad['creative']['title']}. {ad['creative']['body']}" and len(data.items.texts) == 600


def test_cross_surface_engagements_hold_no_item_of_the_users_sequence(tmp_path, default_schema):
    """Neither held-out item nor a training target: a list holding only the training ones would teach the
    co-engagement expert that a listed ad is the next click, which the held-out one never is."""
    world = synthesize(WorldConfig(ads=300, users=40, seed=3), tmp_path, default_schema, workers=1, progress=False)
    data = load_synthetic(world)
    row = {int(ad): r for r, ad in enumerate(data.items.ids)}
    requests = [json.loads(line) for line in (world / "requests.jsonl").read_text().splitlines()]
    dropped = 0
    for u, r in enumerate(requests):
        listed = [row[c["ad_id"]] for c in r["user"]["co_engagement"]]
        kept = [c for c in listed if c not in set(data.users.items[u].tolist())]
        assert data.users.co_items[u] == kept
        dropped += len(listed) - len(kept)
    assert dropped > 0 and sum(map(len, data.users.co_items)) > 0  # the world lists clicked ads, and others


@pytest.mark.parametrize("name, text", [("engagements.jsonl", "garbage\n"), ("requests.jsonl", '{"user": 1}\n')])
def test_a_damaged_world_file_names_the_world(tmp_path, default_schema, name, text):
    world = synthesize(WorldConfig(ads=40, users=3, seed=2), tmp_path, default_schema, workers=1, progress=False)
    with open(world / name, "a", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(InvalidInput) as error:
        load_synthetic(world)
    assert error.value.field == str(world) and "not a world written by" in error.value.message


def test_synthetic_impressions_are_the_logged_ones_before_the_held_out_engagements(tmp_path, default_schema):
    world = synthesize(WorldConfig(ads=600, users=30, seed=2), tmp_path, default_schema, workers=1, progress=False)
    data = load_synthetic(world)
    log = [json.loads(line) for line in (world / "engagements.jsonl").read_text().splitlines()]
    row = {int(ad_id): r for r, ad_id in enumerate(data.items.ids)}
    requests = [json.loads(line) for line in (world / "requests.jsonl").read_text().splitlines()]
    for u, request in enumerate(requests):
        clicks = [h["ts"] for h in request["user"]["history"]]
        first_held_out = clicks[-2] if len(clicks) >= 2 else clicks[0] if clicks else float("inf")
        mine = [e for e in log if e["user_id"] == request["user"]["user_id"]]
        expected = [[row[e["ad_id"]], int(e["event"] == "click")] for e in mine if e["ts"] < first_held_out]
        assert data.users.shown[u].tolist() == expected
        assert len(expected) < len(mine)  # the held-out clicks (and what follows) are left out
    assert any(len(seq) < 3 for seq in data.users.items)  # users with one or two engagements are covered


def test_click_logodds_smooths_each_items_click_rate_toward_the_overall_one():
    items = Items(ids=np.array([10, 11, 12]), text=np.zeros((3, 384), np.float16), category=np.zeros(3, np.int64),
                  advertiser=np.zeros(3, np.int64), bid=np.ones(3, np.float32), categories=["a"])
    none = [np.zeros(0, np.int64)] * 2
    users = Users(none, none, none, [[], []], [[], []], np.zeros((2, 3), np.int64), np.zeros(2, np.int64),
                  shown=[np.array([[0, 1], [0, 1], [1, 0]]), np.array([[1, 0], [0, 0]])])
    data = RecData("tiny", items, users)
    rate = 2 / 5  # item 0: 3 shown, 2 clicked; item 1: 2 shown, none clicked; item 2: never shown
    by_hand = [np.log((2 + 2 * rate) / (1 + 2 * (1 - rate))) - np.log(rate / (1 - rate)),
               np.log((0 + 2 * rate) / (2 + 2 * (1 - rate))) - np.log(rate / (1 - rate)), 0.0]
    assert data.click_logodds(smoothing=2.0) == pytest.approx(by_hand, rel=1e-5)
    users.shown = [np.array([[0, 0]]), np.array([[1, 0]])]  # no click at all: no rate to smooth toward
    assert not data.click_logodds().any()
    users.shown = []  # no impressions logged (MovieLens)
    assert not data.click_logodds().any()


def test_train_items_counts_each_items_engagements_before_the_validation_one():
    items = Items(ids=np.array([10, 11, 12, 13]), text=np.zeros((4, 384), np.float16), category=np.zeros(4, np.int64),
                  advertiser=np.zeros(4, np.int64), bid=np.ones(4, np.float32), categories=["a"])
    seqs = [np.array([0, 1, 0, 3, 2]), np.array([1, 2, 3])]  # trained on: [0, 1, 0] and [1]; 3 and 2 held out
    users = Users(seqs, seqs, seqs, [[], []], [[], []], np.zeros((2, 3), np.int64), np.zeros(2, np.int64))
    data = RecData("tiny", items, users)
    assert data.train_items().tolist() == data.train_items(2).tolist() == [0, 1]  # item 0 twice (repeats count)
    assert data.train_items(3).tolist() == []


def test_a_click_weight_is_refused_for_data_without_impressions(small_movielens, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ANDROMEDA_MOVIELENS", str(small_movielens[0]))
    monkeypatch.setenv("ANDROMEDA_CACHE", str(tmp_path))
    out = tmp_path / "m.safetensors"
    assert main(["train", "--data", "movielens", "--model", "two_tower", "--click-weight", "3", "--out", str(out)]) == 2
    assert "--click-weight" in capsys.readouterr().err and not out.exists()


def test_movielens_logs_no_impressions(small_movielens):
    data = load_movielens(small_movielens[0])
    assert data.users.shown == [] and not data.click_logodds().any()
    assert data.users.interests == [] and data.items.texts == []  # no interest feature: MovieLens declares none


def test_a_text_encoder_failure_is_not_called_a_bad_world(tmp_path, default_schema, monkeypatch):
    world = synthesize(WorldConfig(ads=40, users=3, seed=2), tmp_path, default_schema, workers=1, progress=False)

    def broken(texts):
        raise AttributeError("the sentence model failed")

    monkeypatch.setattr(recdata, "encode_texts_cached", broken)
    with pytest.raises(AttributeError, match="the sentence model failed"):
        load_synthetic(world)


def test_a_single_declared_interest_given_as_a_string_is_one_interest(tmp_path, default_schema):
    world = synthesize(WorldConfig(ads=200, users=5, seed=3), tmp_path, default_schema, workers=1, progress=False)
    lines = (world / "requests.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["user"]["attributes"]["interests"] = "audio_equipment"
    (world / "requests.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert load_synthetic(world).users.interests[0] == ["audio_equipment"]
