"""Non-learned baselines under the learned models' protocol: most-popular, item-kNN, content similarity (to the
user's history) and declared-interest similarity (to the user's declared interests and behaviours).

All are fit on the training interactions only (each user's items before their validation
position) and rank the full corpus with the user's history at the asked position excluded,
returning the same `Ranking` as `evaluate.rank_items`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch

from andromeda_core.models import find_sorted
from andromeda_core.models.evaluate import Ranking, mean_metric, ranking_from_scores
from andromeda_core.models.recdata import RecData
from andromeda_core.models.segments import described_table
from andromeda_core.schema import load_schema


def training_matrix(data: RecData) -> sp.csr_matrix:
    """(U, N) float64 csr: 1 where user u engaged item j in training (repeats count once)."""
    seqs = data.train_sequences()
    rows = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])
    x = sp.csr_matrix((np.ones(len(rows)), (rows, np.concatenate(seqs))), shape=(len(seqs), len(data.items.ids)))
    x.data[:] = 1.0  # the constructor summed repeats
    return x


def unit_columns(x: sp.csr_matrix) -> sp.csr_matrix:
    """(U, N) -> (U, N) csr with every item column scaled to unit L2 norm (empty columns stay 0)."""
    norm = np.sqrt(np.asarray(x.multiply(x).sum(0)).ravel())
    return (x @ sp.diags(np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0))).tocsr()


def _rank_batches(data: RecData, users: np.ndarray, split: int, batch: int, score_fn) -> Ranking:
    """score_fn(users (B,), positions (B,)) -> (B, N) torch float; ranked batch by batch."""
    tops, ranks = [], []
    for first in range(0, len(users), batch):
        us = users[first:first + batch]
        positions = np.array([data.split(u)[split] for u in us])
        top, rank = ranking_from_scores(score_fn(us, positions), data, us, positions)
        tops.append(top)
        ranks.append(rank)
    return Ranking(np.concatenate(tops), np.concatenate(ranks))


def most_popular(data: RecData, users: np.ndarray, split: int = 1, batch: int = 512) -> Ranking:
    """Score of item j = its number of training interactions (repeats counted), the same for every user."""
    counts = np.bincount(np.concatenate(data.train_sequences()), minlength=len(data.items.ids))
    popularity = torch.from_numpy(counts.astype(np.float64))
    return _rank_batches(data, users, split, batch, lambda us, _: popularity.expand(len(us), -1))


def item_similarity(xn: sp.csr_matrix, neighbours: int, chunk: int = 1024) -> sp.csr_matrix:
    """xn (U, N) unit columns -> (N, N) csr cosine similarity, row h cut to its `neighbours` most
    similar items j != h (ties at the cut to the lower row; zero similarities dropped)."""
    if neighbours < 1:
        raise ValueError(f"neighbours must be >= 1, got {neighbours}")
    xnt, n = xn.T.tocsr(), xn.shape[1]
    rows, cols, vals = [], [], []
    for a in range(0, n, chunk):
        sim = torch.from_numpy((xnt[a:a + chunk] @ xn).toarray())  # (C, N)
        sim[torch.arange(sim.shape[0]), torch.arange(a, a + sim.shape[0])] = float("-inf")
        kth = sim.topk(min(neighbours, n - 1), dim=1).values[:, -1:]
        above, tied = sim > kth, sim == kth
        keep = (above | (tied & (tied.cumsum(1) <= neighbours - above.sum(1, keepdim=True)))) & (sim > 0)
        r, c = keep.nonzero(as_tuple=True)
        rows.append(r.numpy() + a)
        cols.append(c.numpy())
        vals.append(sim[r, c].numpy())
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))


def item_knn(data: RecData, users: np.ndarray, split: int = 1, recent: int = 50, neighbours: int | None = None,
             batch: int = 512) -> Ranking:
    """Score of item j = sum over the user's `recent` latest history engagements h of cos(h, j), cosine
    over the binary user x item training matrix; neighbours keeps only each h's most similar items."""
    xn = unit_columns(training_matrix(data))
    xnt, n = xn.T.tocsr(), xn.shape[1]
    sim = item_similarity(xn, neighbours) if neighbours is not None else None

    def scores(us: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        recents = [data.users.items[u][max(p - recent, 0):p] for u, p in zip(us, positions)]
        rows = np.repeat(np.arange(len(us)), [len(r) for r in recents])
        q = sp.csr_matrix((np.ones(len(rows)), (rows, np.concatenate(recents))), shape=(len(us), n))
        if sim is not None:
            return torch.from_numpy((q @ sim).toarray())
        # Q Xn^T Xn without the (N, N) matrix: (B, U) user overlaps, then back to items.
        return torch.from_numpy(np.asarray(xnt @ (q @ xnt).T.toarray()).T.copy())

    return _rank_batches(data, users, split, batch, scores)


def content_similarity(data: RecData, users: np.ndarray, split: int = 1, recent: int = 50, batch: int = 512) -> Ranking:
    """Score of item j = cosine of its text embedding (MiniLM, the ad tower's input) with the mean of the unit text
    embeddings of the user's `recent` latest history engagements: content-based retrieval with nothing trained."""
    text = torch.nn.functional.normalize(torch.from_numpy(data.items.text).double(), dim=1)  # (N, 384)

    def scores(us: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        profile = torch.stack([text[torch.from_numpy(data.users.items[u][max(p - recent, 0):p])].sum(0)
                               for u, p in zip(us, positions)])  # (B, 384); the mean's direction
        return torch.nn.functional.normalize(profile, dim=1) @ text.T

    return _rank_batches(data, users, split, batch, scores)


def declared_profiles(data: RecData) -> torch.Tensor:
    """(U, 384) float64 per user the unit mean of the MiniLM texts of their described declared values (interests,
    behaviours: segments.described_table, looked up by the hashes in Users.segments); 0 for a user with none."""
    hashes, text = (torch.from_numpy(a) for a in described_table(load_schema()))
    profiles = torch.zeros((len(data.users.segments), text.shape[1]), dtype=torch.float64)
    for u, held in enumerate(data.users.segments):
        rows, found = find_sorted(hashes, torch.tensor(held, dtype=torch.int64))
        profiles[u] = text[rows[found]].double().sum(0)
    return torch.nn.functional.normalize(profiles, dim=1)


def declared_similarity(data: RecData, users: np.ndarray, profiles: torch.Tensor, split: int = 1,
                        batch: int = 512) -> Ranking:
    """Score of item j = cosine of its text embedding with the user's row of profiles (declared_profiles): what the
    user says they like, read by the sentence model alone (all 0, so ranked by row, for a user who declares nothing)."""
    text = torch.nn.functional.normalize(torch.from_numpy(data.items.text).double(), dim=1)  # (N, 384)
    return _rank_batches(data, users, split, batch, lambda us, _: profiles[torch.from_numpy(us)] @ text.T)


WINDOWS = (1, 3, 5, 10, 20, 50)  # latest engagements a history baseline reads: chosen per data set (tuned)


def tuned(baseline: Callable[..., Ranking], data: RecData, users: np.ndarray, validation_users: np.ndarray,
          windows: tuple[int, ...] = WINDOWS) -> tuple[Ranking, int]:
    """baseline(data, users, recent=w) at the window w of `windows` with the best score at validation_users'
    validation engagements (the mean of the four metrics: how the learned models' settings are chosen; of equals,
    the shorter window) -> (its ranking of users, w). Untuned, item-kNN over the last 50 on MovieLens held half the
    HR@10 it holds over the last 5."""
    score = {w: mean_metric(baseline(data, validation_users, split=0, recent=w).target_rank) for w in windows}
    best = max(windows, key=score.get)  # max keeps the first of equals
    return baseline(data, users, recent=best), best
