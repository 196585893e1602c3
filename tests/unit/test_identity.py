"""The learned identities' start from co-engagement: against a brute-force cosine over who engaged what, and where
a new model takes it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from andromeda_core.models.identity import co_engagement_start
from andromeda_core.models.train import TrainConfig, new_model
from tests.unit.test_baselines import rec_data

# Training parts (all but the last two): users 0 and 1 engaged the same items, so the 6 x 9 matrix has rank <= 5, which
# ARPACK's rank limit (min(U, N) - 1 = 5) can hold: the start's products are then the cosine exactly.
SEQS = [[0, 1, 2, 8, 8], [2, 1, 0, 1, 8, 8], [0, 3, 4, 8, 8], [5, 3, 6, 8, 8], [6, 7, 1, 5, 8, 8], [4, 4, 2, 8, 8]]


def brute_cosine(seqs: list[list[int]], n_items: int) -> np.ndarray:
    """(N, N) |users of i and j| / sqrt(|users of i| |users of j|) over the training parts."""
    users = [{u for u, s in enumerate(seqs) if j in s[:len(s) - 2]} for j in range(n_items)]
    return np.array([[len(users[i] & users[j]) / math.sqrt(len(users[i]) * len(users[j])) if users[i] and users[j]
                      else 0.0 for j in range(n_items)] for i in range(n_items)])


def test_the_start_is_item_knns_cosine_when_the_rank_fits():
    data, rows = rec_data(SEQS, 9), np.arange(8)  # item 8: never in training
    start = co_engagement_start(data, rows, dim=7, norm=2.0).double()
    assert start.shape == (8, 7) and not start[:, 5:].any()  # columns past the rank (5) stay 0
    # Every engaged item's cosine with itself is 1, so each row's norm, and their RMS, is the norm asked for.
    np.testing.assert_allclose((start @ start.T).numpy(), 4.0 * brute_cosine(SEQS, 9)[:8, :8], atol=1e-5)


def test_a_lower_rank_start_keeps_the_largest_singular_directions():
    data, rows = rec_data(SEQS, 9), np.arange(9)
    start = co_engagement_start(data, rows, dim=2, norm=1.0).double()
    cosine = brute_cosine(SEQS, 9)
    values, vectors = np.linalg.eigh(cosine)  # the cosine is X^T X: its eigenvalues are the squared singular values
    best = (vectors[:, -2:] * values[-2:]) @ vectors[:, -2:].T  # its best rank-2 approximation
    scale = (start.pow(2).sum(1).mean() / np.diag(best).mean()).item()
    np.testing.assert_allclose((start @ start.T).numpy(), scale * best, atol=1e-5)
    assert start[8].abs().max() == 0  # never engaged in training: nothing to start from


def test_a_new_model_starts_its_identities_from_co_engagement_in_its_own_id_order():
    data = rec_data(SEQS, 9)
    data.items.ids = np.array([90, 10, 80, 20, 70, 30, 60, 40, 50])  # the model keeps its ids sorted
    cfg = TrainConfig(min_id_engagements=2, id_start=3.0)
    rows = data.train_items(2)
    model = new_model(data, "moe", cfg)
    order = rows[np.argsort(data.items.ids[rows])]
    assert model.item_ids.tolist() == sorted(data.items.ids[rows].tolist())
    expected = co_engagement_start(data, order, model.dims.dim, 3.0)
    identity = model.ad_tower.identity.weight.detach()
    assert torch.equal(identity[: len(rows), : model.dims.dim], expected)
    assert not identity[-1].any()  # the "no id" row stays 0
    random_start = new_model(data, "moe", TrainConfig(min_id_engagements=2, id_start=0.0)).ad_tower.identity.weight
    assert random_start[: len(rows)].abs().max() < 0.1  # std 0.01


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_the_identities_start_norm_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="id_start must be finite and at least 0"):
        TrainConfig(id_start=bad)
