"""Offline metrics on hand-built rankings."""
from __future__ import annotations

import numpy as np
import pytest

from andromeda_core.models.evaluate import Ranking, crossings, hit_metrics, recall_within


def ranking(ranks: list[int]) -> Ranking:
    return Ranking(top=np.zeros((len(ranks), 1), np.int64), target_rank=np.array(ranks))


def test_hit_rates_and_ndcg_follow_the_held_out_rank():
    m = hit_metrics(ranking([0, 9, 10, 49, 199, 5000]))
    assert m["HR@10"] == pytest.approx(2 / 6) and m["HR@50"] == pytest.approx(4 / 6) and m["HR@200"] == pytest.approx(5 / 6)
    assert m["NDCG@10"] == pytest.approx((1 + 1 / np.log2(11)) / 6)


def test_recall_within_counts_the_reference_items_found():
    reference = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    model_top = np.array([[4, 3, 9, 10, 11], [5, 12, 13, 14, 15]])
    assert recall_within(reference, model_top) == pytest.approx((2 / 4 + 1 / 4) / 2)


def test_crossings_count_users_whose_hit_changes_at_any_cutoff():
    base = ranking([9, 10, 49, 300, 3])
    assert crossings(ranking([10, 9, 49, 250, 4]), base) == 2  # users 0 and 1 cross 10; moves that cross nothing don't count
    assert crossings(ranking([9, 10, 50, 300, 3]), base) == 1
    assert crossings(base, base) == 0
