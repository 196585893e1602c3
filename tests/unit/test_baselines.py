"""Most-popular, item-kNN, content and declared-interest similarity against a plain-Python reading of their
definitions on hand-made data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from andromeda_core.models.baselines import (content_similarity, declared_profiles, declared_similarity, item_knn,
                                             most_popular, training_matrix, tuned)
from andromeda_core.models.evaluate import mean_metric, ranking_from_scores
from andromeda_core.models.recdata import Items, RecData, Users
from andromeda_core.models.segments import described_table, segment_ids

HAND = [[0, 1, 0, 2, 3, 4], [1, 2, 5, 6, 7], [0, 2, 5, 3, 6, 7], [1, 5, 4, 7], [3, 0, 1, 2, 6, 5, 4]]
# Training (all but the last two): counts 0:4 (user 0 twice), 1:4, 2:4, 3:2, 5:3, 6:1, 4:0, 7:0.
# Items 4 and 7 appear only at validation/test positions (3 users each): fitting on those would rank
# them level with item 5.


def rec_data(seqs: list[list[int]], n_items: int) -> RecData:
    items = Items(ids=np.arange(1, n_items + 1), text=np.zeros((n_items, 384), np.float16),
                  category=np.zeros(n_items, np.int64), advertiser=np.zeros(n_items, np.int64),
                  bid=np.ones(n_items, np.float32), categories=["a"])
    arrays = [np.array(s, np.int64) for s in seqs]
    n = len(arrays)
    users = Users(items=arrays, events=[np.ones(len(s), np.int64) for s in arrays],
                  times=[np.arange(len(s)) * 60 for s in arrays], segments=[[] for _ in arrays],
                  co_items=[[] for _ in arrays], context=np.zeros((n, 3), np.int64), now=np.full(n, 10**6))
    return RecData("hand", items, users)


def random_data(seed: int, n_items: int = 9, n_users: int = 6) -> RecData:
    """Short sequences over few items: many ties, repeats within a user."""
    rng = np.random.default_rng(seed)
    return rec_data([rng.integers(0, n_items, rng.integers(3, 9)).tolist() for _ in range(n_users)], n_items)


def brute_ranking(score: dict[int, float], seq: list[int], p: int, n_items: int) -> tuple[list[int], int]:
    """Order all items by (score desc, row asc) with history at -inf; (order, position of the target)."""
    history = set(seq[:p])
    key = {j: -math.inf if j in history else round(score.get(j, 0.0), 9) for j in range(n_items)}
    order = sorted(range(n_items), key=lambda j: (-key[j], j))
    return order, order.index(seq[p])


def brute_popularity(seqs: list[list[int]]) -> dict[int, float]:
    counts: dict[int, float] = {}
    for seq in seqs:
        for j in seq[:len(seq) - 2]:
            counts[j] = counts.get(j, 0) + 1
    return counts


def brute_knn(seqs: list[list[int]], n_items: int, seq: list[int], p: int, recent: int,
              neighbours: int | None) -> dict[int, float]:
    engaged = {j: {u for u, s in enumerate(seqs) if j in s[:len(s) - 2]} for j in range(n_items)}

    def cos(h: int, j: int) -> float:
        both = len(engaged[h] & engaged[j])
        return both / math.sqrt(len(engaged[h]) * len(engaged[j])) if both else 0.0

    score: dict[int, float] = {}
    for h in seq[max(p - recent, 0):p]:
        near = range(n_items)
        if neighbours is not None:
            others = sorted((j for j in range(n_items) if j != h), key=lambda j: (-round(cos(h, j), 12), j))
            near = [j for j in others[:neighbours] if cos(h, j) > 0]
        for j in near:
            score[j] = score.get(j, 0.0) + cos(h, j)
    return score


def check(ranking, data: RecData, split: int, score_of) -> None:
    """score_of(user, sequence, position) -> {item: score} (absent: 0)."""
    n_items = len(data.items.ids)
    for i, u in enumerate(data.eval_users()):
        seq = data.users.items[u].tolist()
        p = data.split(u)[split]
        order, rank = brute_ranking(score_of(u, seq, p), seq, p, n_items)
        assert ranking.top[i].tolist() == order, (u, split)
        assert ranking.target_rank[i] == rank, (u, split)


@pytest.mark.parametrize("split", [0, 1])
def test_most_popular_matches_counting_by_hand(split):
    data = rec_data(HAND, 8)
    ranking = most_popular(data, data.eval_users(), split)
    check(ranking, data, split, lambda u, seq, p: brute_popularity(HAND))


def test_most_popular_ignores_validation_and_test_items_and_excludes_history():
    data = rec_data(HAND, 8)
    ranking = most_popular(data, data.eval_users(), split=1)
    # User 3 at test: history {1, 5, 4}; the rest by training count 0:4, 2:4, 3:2, 6:1, 7:0.
    assert ranking.top[3].tolist() == [0, 2, 3, 6, 7, 1, 4, 5]
    assert ranking.target_rank[3] == 4
    # User 0 at test: history {0, 1, 2, 3}; 5:3, 6:1, then 4 (the target) and 7 tie at 0: 4 goes first.
    assert ranking.top[0][:4].tolist() == [5, 6, 4, 7] and ranking.target_rank[0] == 2


@pytest.mark.parametrize("seed", range(6))
def test_most_popular_matches_counting_on_random_sequences(seed):
    data = random_data(seed)
    seqs = [s.tolist() for s in data.users.items]
    for split in (0, 1):
        check(most_popular(data, data.eval_users(), split), data, split, lambda u, seq, p: brute_popularity(seqs))


@pytest.mark.parametrize("recent,neighbours", [(50, None), (1, None), (2, None), (50, 1), (50, 2), (2, 3)])
def test_item_knn_matches_cosines_by_hand(recent, neighbours):
    for data in [rec_data(HAND, 8)] + [random_data(seed) for seed in range(4)]:
        seqs, n_items = [s.tolist() for s in data.users.items], len(data.items.ids)
        for split in (0, 1):
            ranking = item_knn(data, data.eval_users(), split, recent=recent, neighbours=neighbours)
            check(ranking, data, split, lambda u, seq, p: brute_knn(seqs, n_items, seq, p, recent, neighbours))


def test_a_baselines_window_is_the_one_that_validates_best_and_the_test_split_is_not_read():
    data = random_data(0)
    users, validation = data.eval_users(), data.eval_users()[:5]
    scores = {w: mean_metric(item_knn(data, validation, split=0, recent=w).target_rank) for w in (1, 2, 50)}
    ranking, window = tuned(item_knn, data, users, validation, windows=(1, 2, 50))
    assert scores[window] == max(scores.values()) and window == min(w for w in scores if scores[w] == scores[window])
    assert np.array_equal(ranking.target_rank, item_knn(data, users, recent=window).target_rank)
    for u in users:  # the test items changed: the choice reads validation engagements only
        data.users.items[u][-1] = (data.users.items[u][-1] + 1) % len(data.items.ids)
    assert tuned(item_knn, data, users, validation, windows=(1, 2, 50))[1] == window


def test_item_knn_fits_on_training_positions_only():
    data = rec_data(HAND, 8)
    x = training_matrix(data).toarray()
    assert x[:, [4, 7]].sum() == 0 and x[0, 0] == 1  # user 0's repeat of item 0 counts once
    # User 1 at test: history [1, 2, 5, 6]; item 7 (the target) co-occurs with nothing in training,
    # so it ties at 0 with item 4 (the lower row, first) behind the items that do (0 and 3).
    ranking = item_knn(data, np.array([1]), split=1)
    assert ranking.top[0][:4].tolist() == [0, 3, 4, 7] and ranking.target_rank[0] == 3


def brute_content(text: np.ndarray, seq: list[int], p: int, recent: int) -> dict[int, float]:
    """cos(mean of the unit text vectors of seq's last `recent` before p, repeats included, item j's text)."""
    unit = [[float(x) / math.sqrt(sum(float(y) ** 2 for y in row)) for x in row] for row in text]
    history = seq[max(p - recent, 0):p]
    mean = [sum(unit[h][d] for h in history) / len(history) for d in range(text.shape[1])]
    norm = math.sqrt(sum(x * x for x in mean))
    return {j: sum(m * x for m, x in zip(mean, unit[j])) / norm for j in range(len(text))}


@pytest.mark.parametrize("recent", [50, 1, 3])
def test_content_similarity_matches_cosines_by_hand(recent):
    for seed in range(4):
        data = random_data(seed)
        data.items.text = np.random.default_rng(seed).standard_normal((len(data.items.ids), 24)).astype(np.float16)
        for split in (0, 1):  # 24 dims, not MiniLM's 384: the same cosines, the pure-Python check 16x sooner
            ranking = content_similarity(data, data.eval_users(), split, recent=recent)
            check(ranking, data, split, lambda u, seq, p: brute_content(data.items.text, seq, p, recent))


def unit(v) -> list[float]:
    norm = math.sqrt(sum(float(y) ** 2 for y in v))
    return [float(x) / norm for x in v]


def test_declared_similarity_matches_cosines_by_hand(default_schema):
    """Each user's score of item j: cos(mean of the unit MiniLM rows of the interests and behaviours they declare,
    item j's text). Cohorts and other attributes (country) have no text; a user who declares nothing ranks by row."""
    data = random_data(0)
    data.items.text = np.random.default_rng(0).standard_normal((len(data.items.ids), 384)).astype(np.float16)
    behaviors = default_schema.by_name["behaviors"].vocabulary
    declared = [{"interests": ["running", "jazz"], "country": "US"}, {"behaviors": [behaviors[3]]}, {"country": "FR"},
                {"interests": ["running"], "behaviors": [behaviors[0]]}, {}, {"interests": ["yoga"]}]
    data.users.segments = [segment_ids([u], attributes, default_schema) for u, attributes in enumerate(declared)]
    hashes, table = described_table(default_schema)
    row_of = {int(h): r for r, h in enumerate(hashes)}

    def brute(u: int) -> dict[int, float]:
        rows = [row_of[h] for h in data.users.segments[u] if h in row_of]
        if not rows:
            return {}
        mean = unit([sum(float(table[r][d]) for r in rows) for d in range(384)])
        return {j: sum(m * x for m, x in zip(mean, unit(data.items.text[j]))) for j in range(len(data.items.ids))}

    users = data.eval_users()
    assert {len([h for h in data.users.segments[u] if h in row_of]) for u in users} >= {0, 1, 2}
    for split in (0, 1):
        check(declared_similarity(data, users, declared_profiles(data), split), data, split,
              lambda u, seq, p: brute(u))


def test_ranking_from_scores_breaks_ties_by_row_in_top_and_rank():
    data = rec_data([[0, 1, 2, 3, 4, 5], [3, 6, 5]], 8)
    scores = torch.tensor([[9.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 7.0]] * 2, dtype=torch.float64)
    top, rank = ranking_from_scores(scores, data, np.array([0, 1]), np.array([4, 2]))
    # User 0 (history 0..3): the target 4 is second. User 1 (history 3, 6): the target 5 ties at 1.0 with
    # items 1 and 2, which go first; counting only strictly higher scores would say 3, not 5.
    assert top[0].tolist() == [7, 4, 5, 6, 0, 1, 2, 3] and rank[0] == 1
    assert top[1].tolist() == [0, 7, 4, 1, 2, 5, 3, 6] and rank[1] == 5
    assert scores[0, 0] == 9.0  # the caller's scores are left as they were
