"""Pair features for the ranker: what a two-tower retrieval model cannot compute, because they cross a
candidate with the user's individual history items rather than with one summary of it.

For a user u at position p (history items[u][:p]) and a candidate item j:
- knn_r (r in RECENT): the item-kNN score of j against the user's r most recent engagements, the mean
  over those engagements h != j of cos(h, j), cosine over the binary user x item training matrix
  (andromeda_core.models.baselines.item_knn sums the same terms; the mean keeps every user on one scale),
- pop: log(1 + number of users who engaged j in training).
Fit on the training interactions only (each user's items before their validation engagement), and
leave-one-user-out: user u's own row is taken out of the matrix and the counts for u's features, so a
training target never lends the feature its own co-engagement with the history before it (without
that, every training positive would co-occur with its history in at least one row, u's, while the
held-out item never does). A candidate the training data never saw (a new ad) gets 0 on every feature.

Cost at serving time: with a precomputed item-item similarity table, knn_r is r lookups and adds and a
divide per pair; pop is stored per ad (FLOPS_PER_PAIR).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from andromeda_core.models.recdata import RecData

RECENT = (1, 5, 50)
NAMES = tuple(f"knn{r}" for r in RECENT) + ("pop",)
N_FEATURES = len(NAMES)
FLOPS_PER_PAIR = sum(r + 1 for r in RECENT)  # one add per recent engagement, one divide, per kNN feature


def _inverse_sqrt(x: np.ndarray) -> np.ndarray:
    return np.divide(1.0, np.sqrt(x), out=np.zeros(x.shape, np.float64), where=x > 0)


@dataclass
class PairFeatures:
    """x (U, N) binary csr training matrix, xt its transpose (csr), counts (N,) users per item."""

    x: sp.csr_matrix
    xt: sp.csr_matrix
    counts: np.ndarray

    @classmethod
    def fit(cls, data: RecData) -> "PairFeatures":
        seqs = data.train_sequences()
        rows = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])
        x = sp.csr_matrix((np.ones(len(rows)), (rows, np.concatenate(seqs or [np.zeros(0, np.int64)]).astype(np.int64))),
                          shape=(len(seqs), len(data.items.ids)))
        x.data[:] = 1.0  # the constructor summed repeats
        return cls(x, x.T.tocsr(), np.asarray(x.sum(0)).ravel())

    def dense(self, data: RecData, users: np.ndarray, positions: np.ndarray, keep: int | None = None) -> torch.Tensor:
        """(B, N, N_FEATURES) float32 features of every item for users (B,) at positions (B,); keep: the
        history holds only the last `keep` engagements (a short-history user)."""
        return self.pairs(data, users, positions, None, keep)

    def pairs(self, data: RecData, users: np.ndarray, positions: np.ndarray, candidates: np.ndarray | None,
              keep: int | None = None) -> torch.Tensor:
        """(B, C, N_FEATURES) float32 features of candidates (C,) item rows (None: every item) for users
        (B,) at positions (B,)."""
        n = self.x.shape[1]
        cols = np.arange(n) if candidates is None else np.asarray(candidates, np.int64)
        own = self.x[users]  # (B, N): the users' own training rows, taken out of every count
        own_c = own[:, cols].toarray() if candidates is not None else own.toarray()
        left_c = self.counts[cols][None, :] - own_c  # (B, C) users per candidate, u excluded
        inv_c = _inverse_sqrt(left_c)
        xc_t = self.xt[cols] if candidates is not None else self.xt  # (C, U)
        out = []
        for r in RECENT:
            recent = min(r, keep or r)
            windows = [data.users.items[u][max(p - recent, 0):p] for u, p in zip(users, positions)]
            lengths = np.array([len(w) for w in windows])
            rows = np.repeat(np.arange(len(users)), lengths)
            hist = np.concatenate(windows or [np.zeros(0, np.int64)]).astype(np.int64)
            # q_h / sqrt(n'_h) per engagement h of the window (repeats summed by the constructor)
            n_left = self.counts[hist] - np.asarray(own[rows, hist]).ravel()
            qn = sp.csr_matrix((_inverse_sqrt(n_left.astype(np.float64)), (rows, hist)), shape=(len(users), n))
            # sum_h qn_h (C_hj - x_uh x_uj), C = X^T X: the overlap through every row, then u's own row out
            through_all = np.asarray((xc_t @ (qn @ self.xt).toarray().T).T)  # (B, C)
            through_own = np.asarray(qn.multiply(own).sum(1)) * own_c
            cos_sum = (through_all - through_own) * inv_c
            q = sp.csr_matrix((np.ones(len(rows)), (rows, hist)), shape=(len(users), n))
            cos_sum -= (q[:, cols].toarray() if candidates is not None else q.toarray()) * (left_c > 0)  # h == j terms
            out.append(cos_sum / np.maximum(lengths, 1)[:, None])
        out.append(np.log1p(left_c))
        return torch.from_numpy(np.stack(out, -1).astype(np.float32))
