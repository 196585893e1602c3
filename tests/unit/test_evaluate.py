"""Offline metrics on hand-built rankings; lossy storage ranked as served (scan, then exact rescoring)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from andromeda_core.models.evaluate import (Ranking, crossings, hit_metrics, rank_items, recall_within, rescored,
                                            top_columns)
from andromeda_core.models.retrieval import RetrievalModel
from tests.unit.test_models import DIMS, tiny_data


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


def test_rescoring_replaces_the_scan_shortlist_scores_and_drops_the_rest():
    torch.manual_seed(0)
    users, exact = torch.randn(2, 4), torch.randn(9, 4)
    dot = SimpleNamespace(score=lambda u, ads: u @ ads.T)
    scan = users @ exact.T + 0.3 * torch.randn(2, 9)
    scan[1, 2:] = float("-inf")  # only two candidates left for user 1 (history masked)
    out = rescored(dot, users, scan, exact, m=4)
    for b in range(2):
        short = set(scan[b].topk(4).indices.tolist()) - set(torch.nonzero(scan[b] == float("-inf")).flatten().tolist())
        kept = set(torch.nonzero(out[b] > float("-inf")).flatten().tolist())
        assert kept == short
        assert torch.allclose(out[b, sorted(kept)], (users[b] @ exact.T)[sorted(kept)])


def test_int8_with_rescoring_ranks_like_fp32_when_the_shortlist_covers_the_truth():
    torch.manual_seed(0)
    data, model = tiny_data(), RetrievalModel("moe", DIMS).eval()
    users = data.eval_users()
    fp32 = rank_items(model, data, users, progress=False)
    served = rank_items(model, data, users, "int8", rescore=2, progress=False)  # 2 x 1000 covers all 40 items
    assert served.target_rank.tolist() == fp32.target_rank.tolist() and np.array_equal(served.top, fp32.top)
    scan_only = rank_items(model, data, users, "int8", progress=False)
    assert not np.array_equal(scan_only.top, fp32.top)  # int8 alone does move items at this size


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.integers(1, 310), st.integers(0, 2**31 - 1))
def test_top_columns_are_the_first_k_of_a_stable_descending_sort(b, n, k, seed):
    """Many ties and -inf (history) included: the same columns in the same order, ties to the lower column."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 4, (b, n), generator=g).float()
    scores[torch.rand(b, n, generator=g) < 0.3] = float("-inf")
    want = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(top_columns(scores, k), want)
