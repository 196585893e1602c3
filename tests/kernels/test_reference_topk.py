"""The reference top-k against a plain Python sort, at odd sizes with many ties."""
from __future__ import annotations

import pytest
import torch

from kernels.reference.topk import topk_by_score_then_id


@pytest.mark.parametrize("B, m, k", [(1, 7, 3), (3, 83, 10), (2, 1151, 100), (4, 5, 9), (1, 0, 4)])
def test_matches_python_sort(B, m, k):
    gen = torch.Generator().manual_seed(B * 1000 + m)
    scores = torch.randint(0, 5, (B, m), generator=gen).float() / 4  # few distinct values: many ties
    scores[scores == 1.0] = float("nan")
    ids = torch.randperm(10 * m + 1, generator=gen)[:m].repeat(B, 1)
    valid = torch.rand((B, m), generator=gen) < 0.7
    got_ids, got_scores = topk_by_score_then_id(scores, ids, valid, k)
    for b in range(B):
        entries = sorted(((-(s if s == s else float("-inf")), i) for s, i, v in
                          zip(scores[b].tolist(), ids[b].tolist(), valid[b].tolist()) if v))[:k]
        want_ids = [i for _, i in entries] + [-1] * (k - len(entries))
        want_scores = [-s for s, _ in entries] + [float("-inf")] * (k - len(entries))
        assert got_ids[b].tolist() == want_ids
        assert got_scores[b].tolist() == want_scores



def test_nan_ranks_as_minus_infinity_and_infinities_stay():
    """NaN ties with -inf (then the lower id first); +inf and -inf come back as they are, not as float32's extremes."""
    inf, nan = float("inf"), float("nan")
    scores = torch.tensor([[1.0, -inf, nan, inf, -inf, 0.5]])
    ids = torch.tensor([[10, 14, 12, 11, 13, 15]])
    got_ids, got_scores = topk_by_score_then_id(scores, ids, torch.ones_like(ids, dtype=torch.bool), 6)
    assert got_ids.tolist() == [[11, 10, 15, 12, 13, 14]]
    assert got_scores.tolist() == [[inf, 1.0, 0.5, -inf, -inf, -inf]]


def test_the_largest_id_with_a_score_of_minus_infinity_still_comes_before_the_invalid():
    """Invalid entries sort by the id key 2**63 - 1, which a valid ad may hold too (types.INT64 admits it): with k at
    least the entries, a valid one ranked after an invalid one at that key, behind a missing place (a review's fuzz)."""
    largest = 2**63 - 1
    scores = torch.tensor([[float("-inf"), float("nan"), 1.0]])
    got_ids, _ = topk_by_score_then_id(scores, torch.tensor([[-1, largest, 7]]), torch.tensor([[False, True, True]]), 3)
    assert got_ids.tolist() == [[7, largest, -1]]
