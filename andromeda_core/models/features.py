"""Pair features for the ranker: what a two-tower retrieval model cannot compute, because they cross a
candidate with the user's individual history items rather than with one summary of it.

For a user u at position p (history items[u][:p]) and a candidate item j:
- knn_r (r in RECENT): the item-kNN score of j against the user's r most recent engagements, the mean
  over those engagements h != j of cos(h, j), cosine over the binary user x item training matrix
  (andromeda_core.models.baselines.item_knn sums the same terms; the mean keeps every user on one scale),
- pop: log(1 + number of users who engaged j in training),
- interest: 1 if one of the interests the user declares (an interest name, underscores read as spaces) occurs
  as whole words in j's creative text (Items.texts), else 0: the exact match of a declared interest that a
  dot product of dense towers only approximates (on the synthetic world, the MoE plus 4 x this feature ranked
  the held-out engagement into the top 10 1.3x as often as the MoE alone, in expectation over the world's
  engagements). It reads no engagements; data without declared interests or texts (MovieLens) has 0.
The engagement features are fit on the training interactions only (each user's items before their validation engagement), and
leave-one-user-out: user u's own row is taken out of the matrix and the counts for u's features, so a
training target never lends the feature its own co-engagement with the history before it (without
that, every training positive would co-occur with its history in at least one row, u's, while the
held-out item never does). A candidate the training data never saw (a new ad) gets 0 on each of them.

Cost at serving time: with a precomputed item-item similarity table, knn_r is r lookups and adds and a
divide per pair; pop is stored per ad; interest is one lookup per pair in the set of ads that the user's few
declared interests match (an inverted index from interest to ads, built as ads are written) (FLOPS_PER_PAIR).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from andromeda_core.models.recdata import RecData
from andromeda_core.models.segments import words

RECENT = (1, 5, 50)
NAMES = tuple(f"knn{r}" for r in RECENT) + ("pop", "interest")
N_FEATURES = len(NAMES)
FROM_ENGAGEMENTS = NAMES.index("interest")  # the features before it read engagements: a new ad has none of them
FLOPS_PER_PAIR = sum(r + 1 for r in RECENT) + 1  # one add per recent engagement, one divide, per kNN feature; the
# interest lookup


def interest_matches(texts: list[str], interests: list[list[str]], n_items: int) -> sp.csr_matrix:
    """(U, N) binary csr for users' declared interests (U lists of names) and items' texts (N, or none): 1 where
    one of user u's interests occurs as whole words, in order, in item j's text (case and underscores ignored)."""
    declared = [[words(name) for name in names] for names in interests]  # each user's interests as word tuples
    phrases = {phrase for user in declared for phrase in user} - {()}
    longest = max(map(len, phrases), default=0)
    items_of: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for j, text in enumerate(texts):
        w = words(text)
        for phrase in {w[s:s + n] for n in range(1, longest + 1) for s in range(len(w) - n + 1)} & phrases:
            items_of[phrase].append(j)
    matched = [sorted(set().union(*(items_of.get(phrase, ()) for phrase in user))) for user in declared]
    rows = np.repeat(np.arange(len(matched)), [len(m) for m in matched])
    cols = np.concatenate([np.array(m, np.int64) for m in matched] or [np.zeros(0, np.int64)])
    return sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(interests), n_items))


def _inverse_sqrt(x: np.ndarray) -> np.ndarray:
    return np.divide(1.0, np.sqrt(x), out=np.zeros(x.shape, np.float64), where=x > 0)


@dataclass
class PairFeatures:
    """x (U, N) binary csr training matrix, xt its transpose (csr), counts (N,) users per item, interest (U, N)
    binary csr: the declared interests' matches (interest_matches)."""

    x: sp.csr_matrix
    xt: sp.csr_matrix
    counts: np.ndarray
    interest: sp.csr_matrix

    @classmethod
    def fit(cls, data: RecData) -> "PairFeatures":
        seqs = data.train_sequences()
        rows = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])
        x = sp.csr_matrix((np.ones(len(rows)), (rows, np.concatenate(seqs or [np.zeros(0, np.int64)]).astype(np.int64))),
                          shape=(len(seqs), len(data.items.ids)))
        x.data[:] = 1.0  # the constructor summed repeats
        if (data.users.interests and len(data.users.interests) != len(seqs)) or len(data.items.texts) not in (0, x.shape[1]):
            raise ValueError(f"{len(data.users.interests)} users' interests and {len(data.items.texts)} item texts for "
                             f"{len(seqs)} users and {x.shape[1]} items")
        interest = (interest_matches(data.items.texts, data.users.interests, x.shape[1]) if data.users.interests
                    else sp.csr_matrix(x.shape, dtype=np.float32))
        return cls(x, x.T.tocsr(), np.asarray(x.sum(0)).ravel(), interest)

    def live(self) -> tuple[bool, ...]:
        """(F,) whether each feature can be other than 0: interest only where some declared interest matches."""
        return tuple(self.interest.nnz > 0 if name == "interest" else True for name in NAMES)

    def dense(self, data: RecData, users: np.ndarray, positions: np.ndarray, keep: int | None = None,
              new_ads: bool = False) -> torch.Tensor:
        """(B, N, N_FEATURES) float32 features of every item for users (B,) at positions (B,); keep: the
        history holds only the last `keep` engagements (a short-history user); new_ads: every item as one created
        after training (the features read from engagements 0, interest kept)."""
        out = self.pairs(data, users, positions, None, keep)
        if new_ads:
            out[..., :FROM_ENGAGEMENTS] = 0.0
        return out

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
        out.append(self.interest[users][:, cols].toarray())
        return torch.from_numpy(np.stack(out, -1).astype(np.float32))
