"""Training and evaluation data in one form for both data sets (synthetic world, MovieLens).

Items: per item its text (MiniLM embedding), category, advertiser and bid. Users: engagement
sequences of item rows in time order, plus segments (cohorts and declared attributes, hashed), cross-surface
engagements and serving context, and (synthetic worlds, which log them) the impressions before the held-out engagements,
clicked or not.
Protocol: per user the last engagement is the test target, the one before it the validation
target; every earlier position (with its prefix as history) is a training example. Cross-surface
engagements never include an item of the user's sequence: the held-out two would be handed to the co-engagement
expert, and training targets alone there would teach it a link that the held-out ones never show.
"""
from __future__ import annotations

import csv
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from andromeda_core.config import load_settings
from andromeda_core.models.segments import mentions, segment_ids
from andromeda_core.models.text import encode_texts_cached
from andromeda_core.schema import Schema, attribute_values, load_schema
from andromeda_core.synth import read_truth, world_files

CLICK_SMOOTHING = 2.0  # impressions at the overall click rate added to each item's counts (RecData.click_logodds)
EVENTS = ("impression", "click", "like", "share", "conversion", "hide")


@dataclass
class Items:
    ids: np.ndarray  # (N,) external ids (ad_id / movieId)
    text: np.ndarray  # (N, 384) float16
    category: np.ndarray  # (N,) int64 in [0, n_categories)
    advertiser: np.ndarray  # (N,) int64 raw advertiser id (hashed by the tower)
    bid: np.ndarray  # (N,) float32
    categories: list[str]
    texts: list[str] = field(default_factory=list)  # (N,) the creative's words (synthetic: title and body), which
    # the ranker's interest feature matches declared interests in; empty when none are kept (MovieLens)
    mentions: np.ndarray | None = None  # (N, m) int64 hashes of the described values each text mentions
    # (segments.mentions), -1 padding; None (MovieLens): none

    def __post_init__(self):
        if self.mentions is None:
            self.mentions = np.full((len(self.ids), 0), -1, np.int64)


@dataclass
class Users:
    items: list[np.ndarray]  # per user: item rows engaged, time order
    events: list[np.ndarray]  # per user: event type index (EVENTS)
    times: list[np.ndarray]  # per user: seconds
    segments: list[list[int]]  # per user: segment ids (andromeda_core.models.segments)
    co_items: list[list[int]]  # item rows engaged on other surfaces
    context: np.ndarray  # (U, 3) int64: surface, placement, hour (0 = unknown for the first two)
    now: np.ndarray  # (U,) request time
    shown: list[np.ndarray] = field(default_factory=list)  # per user (K, 2) int64: the impressions logged before
    # the held-out engagements (item row, clicked 0/1); empty when none are logged
    interests: list[list[str]] = field(default_factory=list)  # per user: the interests declared (the request's
    # attributes); empty when users declare none (MovieLens)


@dataclass
class RecData:
    name: str
    items: Items
    users: Users
    truth: dict[str, np.ndarray] = field(default_factory=dict)  # synthetic only: truth.npz's arrays and item_ad

    def split(self, user: int) -> tuple[int, int]:
        """(validation position, test position) in the user's sequence."""
        n = len(self.users.items[user])
        return n - 2, n - 1

    def eval_users(self) -> np.ndarray:
        return np.array([u for u, seq in enumerate(self.users.items) if len(seq) >= 3])

    def train_examples(self) -> np.ndarray:
        """(n, 2) int64: (user, position of the target); history is everything before it."""
        rows = [(u, p) for u, seq in enumerate(self.users.items) for p in range(1, len(seq) - 2)]
        return np.array(rows, dtype=np.int64).reshape(-1, 2)

    def train_sequences(self) -> list[np.ndarray]:
        """Per user the items engaged before their validation engagement: all that models and baselines fit on."""
        return [seq[: max(self.split(u)[0], 0)] for u, seq in enumerate(self.users.items)]

    def click_logodds(self, smoothing: float = CLICK_SMOOTHING) -> np.ndarray:
        """(N,) float32 per item: the log-odds of a click per impression logged before the held-out
        engagements (Users.shown), each item's counts smoothed toward the overall click rate by `smoothing`
        impressions, minus the log-odds of that rate; 0 for an item never shown, and for every item when no
        impressions are logged (MovieLens) or none or all of them were clicked."""
        n = len(self.items.ids)
        shown = np.concatenate(self.users.shown or [np.zeros((0, 2), np.int64)])
        rate = shown[:, 1].mean() if len(shown) else 0.0
        if not 0 < rate < 1:
            return np.zeros(n, np.float32)
        seen, clicked = np.bincount(shown[:, 0], minlength=n), np.bincount(shown[:, 0], weights=shown[:, 1], minlength=n)
        odds = (clicked + smoothing * rate) / (seen - clicked + smoothing * (1 - rate))
        return (np.log(odds) - np.log(rate / (1 - rate))).astype(np.float32)

    def train_items(self, at_least: int = 1) -> np.ndarray:
        """Sorted item rows engaged in training at least `at_least` times (repeats counted). With 1: every item
        a model has seen, all others are new to it (cold); a model learns an identity for those engaged at least
        TrainConfig.min_id_engagements times."""
        rows = np.concatenate(self.train_sequences() or [np.zeros(0, np.int64)]).astype(np.int64)
        return np.flatnonzero(np.bincount(rows, minlength=len(self.items.ids)) >= at_least)


def load_synthetic(world: Path, max_ads: int | None = None) -> RecData:
    """Items = the world's ads (latest upsert); users = its requests, histories = their clicks."""
    schema = load_schema()
    with world_files(world):
        ads: dict[int, dict] = {}
        with open(world / "events.jsonl", encoding="utf-8") as f:
            for line in f:
                event = json.loads(line)
                if event["op"] == "upsert" and (max_ads is None or event["ad"]["ad_id"] <= max_ads):
                    ads[event["ad"]["ad_id"]] = event["ad"]
        order = sorted(ads)
        categories = sorted({ads[i]["creative"]["category"] for i in order})
        texts = [f"{ads[i]['creative']['title']}. {ads[i]['creative']['body']}" for i in order]
    text = encode_texts_cached(texts)  # outside: the text encoder's failure is not the world's
    with world_files(world):
        items = Items(ids=np.array(order), text=text,
                      category=np.array([categories.index(ads[i]["creative"]["category"]) for i in order]),
                      advertiser=np.array([ads[i]["advertiser_id"] for i in order]),
                      bid=np.array([ads[i]["bid"] for i in order], np.float32), categories=categories, texts=texts,
                      mentions=mentions(texts, schema))
        users, truth = _synthetic_users(world, schema, {ad_id: r for r, ad_id in enumerate(order)})
        truth["item_ad"] = np.array(order) - 1  # each item's row in the world's ad arrays
    return RecData("synthetic", items, users, truth)


def _synthetic_users(world: Path, schema: Schema, row: dict[int, int]) -> tuple[Users, dict[str, np.ndarray]]:
    """The world's users (row: ad id -> item row) and its truth arrays."""
    surfaces, placements = schema.by_name["surface"], schema.by_name["placement"]
    seqs, events, times, segments, co, context, now, user_ids = [], [], [], [], [], [], [], {}
    interests: list[list[str]] = []
    with open(world / "requests.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            user_ids[r["user"]["user_id"]] = len(seqs)
            hist = [h for h in r["user"]["history"] if h["ad_id"] in row]
            seqs.append(np.array([row[h["ad_id"]] for h in hist], np.int64))
            events.append(np.array([EVENTS.index(h["event"]) for h in hist], np.int64))
            times.append(np.array([h["ts"] for h in hist], np.int64))
            segments.append(segment_ids(r["user"]["cohorts"], r["user"]["attributes"], schema))
            declared = r["user"]["attributes"].get("interests", [])
            interests.append(attribute_values(declared))
            clicked = set(seqs[-1].tolist())  # the world draws them from the same pool as the clicks
            co.append([row[c["ad_id"]] for c in r["user"]["co_engagement"]
                       if c["ad_id"] in row and row[c["ad_id"]] not in clicked])
            ctx = r["context"]
            context.append([surfaces.value_index(ctx["surface"]) + 1, placements.value_index(ctx["placement"]) + 1,
                            ctx["ts"] // 3600 % 24])
            now.append(ctx["ts"])
    shown = _impressions(world / "engagements.jsonl", row, user_ids, times)
    truth = read_truth(world, lambda saved: {name: saved[name] for name in saved.files
                                             if name not in ("config", "generator")})
    return Users(seqs, events, times, segments, co, np.array(context, np.int64), np.array(now, np.int64), shown,
                 interests), truth


def _impressions(log: Path, row: dict[int, int], user_ids: dict[int, int],
                 times: list[np.ndarray]) -> list[np.ndarray]:
    """Per user (user_ids: user id -> index) the impressions of ads in `row`, (K, 2) int64 item row,
    clicked: those logged strictly before the user's first held-out engagement (RecData.split: the
    validation one; with a single engagement, the test one)."""
    cut = [t[max(len(t) - 2, 0)] if len(t) else np.inf for t in times]
    before: list[list[tuple[int, int]]] = [[] for _ in times]
    with open(log, encoding="utf-8") as f:
        for line in f:
            e = json.loads(line)
            u = user_ids.get(e["user_id"])
            if u is None or e["ad_id"] not in row:
                continue
            if e["ts"] < cut[u]:
                before[u].append((row[e["ad_id"]], int(e["event"] == "click")))
    return [np.array(s, np.int64).reshape(-1, 2) for s in before]


def load_movielens(directory: Path | None = None) -> RecData:
    """MovieLens ml-latest-small: items = movies (title + genres text), users = their ratings in time order; ratings
    of one second in the order of a hash of (user, movie id): the file's order (by movie id) would let a sequential
    model learn that the held-out rating is often its second's highest movie id."""
    directory = directory or load_settings().movielens_dir
    with open(directory / "movies.csv", encoding="utf-8") as f:
        movies = list(csv.DictReader(f))
    genres = sorted({m["genres"].split("|")[0] for m in movies})
    texts = [f"{m['title']}. {m['genres'].replace('|', ', ')}" for m in movies]
    items = Items(ids=np.array([int(m["movieId"]) for m in movies]), text=encode_texts_cached(texts),
                  category=np.array([genres.index(m["genres"].split("|")[0]) for m in movies]),
                  advertiser=np.zeros(len(movies), np.int64), bid=np.ones(len(movies), np.float32), categories=genres)
    row = {int(m["movieId"]): r for r, m in enumerate(movies)}
    by_user: dict[int, list[tuple[int, int, float]]] = {}
    with open(directory / "ratings.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            by_user.setdefault(int(r["userId"]), []).append((int(r["timestamp"]), row[int(r["movieId"])], float(r["rating"])))
    seqs, events, times = [], [], []
    for user in sorted(by_user):
        ratings = sorted(by_user[user], key=lambda r: (r[0], zlib.crc32(f"{user}:{items.ids[r[1]]}".encode())))
        seqs.append(np.array([m for _, m, _ in ratings], np.int64))
        events.append(np.array([EVENTS.index("like" if s >= 4 else "click") for _, _, s in ratings], np.int64))
        times.append(np.array([t for t, _, _ in ratings], np.int64))
    n = len(seqs)
    users = Users(seqs, events, times, [[] for _ in range(n)], [[] for _ in range(n)], np.zeros((n, 3), np.int64),
                  np.array([t[-1] + 1 for t in times], np.int64))
    return RecData("movielens", items, users)
