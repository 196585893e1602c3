"""Offline quality: full-corpus ranking per user (history excluded), HR@K, NDCG@10, recall of the
ranker's and (synthetic) the true top-100 inside a model's top-1000, FLOPs per pair, bytes per ad.

Lossy storage is ranked as the retriever serves it: scan-only, or with the scan's top rescore * 1000
rescored from the exact float32 vectors (user towers then also read the exact vectors)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from andromeda_core.models import score_each
from andromeda_core.models.features import N_FEATURES, RECENT, PairFeatures
from andromeda_core.models.recdata import RecData
from andromeda_core.quantization import int8_blocks, round_trip
from andromeda_core.models.retrieval import RetrievalModel, user_inputs

TOP = 1000


def bytes_per_ad(model: RetrievalModel, dtype: str, rescore: int = 0) -> tuple[int, int]:
    """(bytes the scan reads per ad, bytes the index holds per ad, the exact copy included)."""
    S = model.dims.stored
    scanned = {"fp32": 4 * S, "fp16": 2 * S, "int8": S + 4 * int8_blocks(S)}[dtype]
    if model.pair_features:  # the ranker also reads the text embedding (fp16), and per pair one float32
        scanned += 2 * 384 + 4 * (sum(RECENT) + 1)  # similarity per recent engagement and the popularity (interest
        # is a lookup in the user's matches, built per request from an inverted index: nothing per ad)
    return scanned, scanned + (4 * S if rescore else 0)


@dataclass
class Ranking:
    top: np.ndarray  # (U, TOP) item rows, best first
    target_rank: np.ndarray  # (U,) 0-based rank of the held-out item (>= TOP: not found)


def rescored(model: RetrievalModel, state, scan: torch.Tensor, exact: torch.Tensor, m: int) -> torch.Tensor:
    """scan (B, N) scores -> (B, N): the scan's top m rescored from exact (N, S) vectors, the rest -inf."""
    short = scan.topk(min(m, scan.shape[1]), dim=1)
    found = short.values != float("-inf")
    scores = score_each(model.score, state, exact[short.indices], found).masked_fill(~found, float("-inf"))
    return torch.full_like(scan, float("-inf")).scatter(1, short.indices, scores)


def without_history(scores: torch.Tensor, data: RecData, users: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """scores (B, N) with each user's history before their position set to -inf, in place; returns scores."""
    for i, (u, p) in enumerate(zip(users, positions)):
        scores[i, torch.from_numpy(data.users.items[u][:p])] = float("-inf")
    return scores


def ranking_from_scores(scores: torch.Tensor, data: RecData, users: np.ndarray,
                        positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores (B, N) float for users (B,) at positions (B,) -> (top (B, min(TOP, N)), target_rank (B,)).

    History items items[u][:p] score -inf; the target is items[u][p]. Ties go to the lower item row,
    in top and in target_rank alike (target_rank < k iff the target is in top[:k]): counting only
    strictly higher scores would put a target tied with thousands of zero-score items near the top."""
    scores = without_history(scores.clone(), data, users, positions)
    return top_columns(scores, TOP).numpy(), rank_of_targets(scores, data, users, positions)


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, min(k, N)) int64: each row's k highest columns of scores (B, N), best first, ties to the lower column: the
    first k of a stable descending sort, which sorts only the columns at or above each row's k-th highest value
    (3.1x faster for 16 x 10,000 and k = 1,000 on one thread)."""
    b, n = scores.shape
    if k >= n:
        return torch.sort(scores, dim=1, descending=True, stable=True).indices
    kth = scores.kthvalue(n - k + 1, dim=1, keepdim=True).values  # (B, 1)
    rows, cols = (scores >= kth).nonzero(as_tuple=True)  # at least k per row, each row's in column order
    counts = torch.bincount(rows, minlength=b)
    slot = torch.arange(len(rows)) - (torch.cumsum(counts, 0) - counts)[rows]
    kept = torch.full((b, int(counts.max())), n, dtype=torch.long)  # padded with column n at -inf, after every
    values = torch.full(kept.shape, float("-inf"), dtype=scores.dtype)  # real column (a stable sort keeps them last)
    kept[rows, slot], values[rows, slot] = cols, scores[rows, cols]
    return kept.gather(1, torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k])


def rank_of_targets(scores: torch.Tensor, data: RecData, users: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(B,) the target_rank of ranking_from_scores, for scores (B, N) whose history is already at -inf."""
    targets = torch.tensor([data.users.items[u][p] for u, p in zip(users, positions)])
    target_scores = scores[torch.arange(len(users)), targets][:, None]
    tied_before = (scores == target_scores) & (torch.arange(scores.shape[1]) < targets[:, None])
    return ((scores > target_scores) | tied_before).sum(1).numpy()


def corpus_scores(model: RetrievalModel, state, stored: torch.Tensor, text: torch.Tensor, cross: torch.Tensor | None,
                  chunk: int = 512) -> torch.Tensor:
    """(B, N) every item's score (stored (N, S), text (N, 384), pair features cross (B, N, F) or None) for the B
    users of state, `chunk` items at a time."""
    return torch.cat([model.score(state, stored[a:a + chunk], text[a:a + chunk],
                                  None if cross is None else cross[:, a:a + chunk]) for a in range(0, len(stored), chunk)], 1)


@torch.no_grad()
def rank_items(model: RetrievalModel, data: RecData, users: np.ndarray, dtype: str = "fp32", split: int = 1,
               rescore: int = 0, keep: int | None = None, content_only: bool = False, batch: int = 16,
               chunk: int = 512, progress: bool = True, pair: PairFeatures | None = None) -> Ranking:
    """Each user's state at their test (split=1) or validation (split=0) position ranks the full corpus,
    `chunk` items at a time (512 keeps the ranker's (batch, chunk, 256) hidden layer cache-sized: 2.4x
    faster than 4096 on 2 cores, the same ranking; the MoE is as fast either way).
    keep: the user towers read only the last `keep` engagements (a short-history user); content_only:
    every ad is embedded as if created after training (no learned identity, no pair features read from engagements:
    the ranker keeps interest). The ranker's pair features (pair: those fit on data; fit here when None) read the same
    (last `keep`) history as its towers."""
    known = torch.zeros(len(data.items.ids), dtype=torch.bool) if content_only else None
    pair = (pair or PairFeatures.fit(data)) if model.pair_features else None  # a new ad: interest only (dense)
    exact = model.item_vectors(data.items, known=known)
    stored = round_trip(exact, dtype)
    text = torch.from_numpy(data.items.text).float()
    tops, ranks = [], []
    label = f"rank {model.kind} {dtype}" + (f" rescore {rescore}x" if rescore else "")
    for first in tqdm(range(0, len(users), batch), desc=label, disable=not progress):
        us = users[first:first + batch]
        positions = np.array([data.split(u)[split] for u in us])
        state = model.users(user_inputs(data, exact if rescore else stored, us, positions, model.dims.history, keep))
        cross = pair.dense(data, us, positions, keep, new_ads=content_only) if pair is not None else None
        scores = corpus_scores(model, state, stored, text, cross, chunk)
        if rescore:  # the shortlist is of items the user may be shown
            scores = rescored(model, state, without_history(scores, data, us, positions), exact, rescore * TOP)
        top, rank = ranking_from_scores(scores, data, us, positions)
        tops.append(top)
        ranks.append(rank)
    return Ranking(np.concatenate(tops), np.concatenate(ranks))


CUTOFFS = (10, 50, 200)


def per_user_metrics(target_rank: np.ndarray) -> dict[str, np.ndarray]:
    """target_rank (U,) 0-based -> HR@K (U,) 0/1 for each cutoff and NDCG@10 (U,) per user."""
    rank = np.asarray(target_rank)
    return {**{f"HR@{k}": (rank < k).astype(np.float64) for k in CUTOFFS},
            "NDCG@10": np.where(rank < 10, 1 / np.log2(rank + 2.0), 0.0)}


def expected_metrics(top: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """top (U, T) item rows best first, p (U, N) each user's probability that the held-out item is each item ->
    per_user_metrics' names, each (U,): the metric's expectation over that probability instead of one draw."""
    mass = np.take_along_axis(p, top[:, :max(CUTOFFS)], axis=1)
    return {**{f"HR@{k}": mass[:, :k].sum(1) for k in CUTOFFS},
            "NDCG@10": (mass[:, :10] / np.log2(np.arange(2, 2 + mass[:, :10].shape[1]))).sum(1)}


def mean_metric(target_rank: np.ndarray) -> float:
    """The mean of HR@10, HR@50, HR@200 and NDCG@10 over users (target_rank (U,)): what validation maximises."""
    return float(np.mean([v.mean() for v in per_user_metrics(target_rank).values()]))


def hit_metrics(r: Ranking) -> dict[str, float]:
    return {name: float(values.mean()) for name, values in per_user_metrics(r.target_rank).items()}


def crossings(r: Ranking, reference: Ranking) -> int:
    """Users whose held-out item is a hit at some cutoff in one ranking and a miss in the other."""
    return int(np.any([(r.target_rank < k) != (reference.target_rank < k) for k in CUTOFFS], axis=0).sum())


def recall_within(reference_top100: np.ndarray, model_top: np.ndarray) -> float:
    """Mean share of each user's reference top-100 found inside the model's top-1000."""
    return float(np.mean([len(set(ref) & set(top)) / len(ref) for ref, top in zip(reference_top100, model_top)]))


def counted_flops_per_pair(model: RetrievalModel, data: RecData, n: int = 512) -> float:
    """FLOPs torch.utils.flop_counter counts (matmul-type ops only) scoring n candidates for one request."""
    n = min(n, len(data.items.ids))
    with torch.no_grad():
        stored = model.item_vectors(data.items, np.arange(n))
        user = data.eval_users()[:1]
        state = model.users(user_inputs(data, stored.new_zeros((len(data.items.ids), stored.shape[1])), user,
                                        np.array([data.split(user[0])[1]]), model.dims.history))
        text = torch.from_numpy(data.items.text[:n]).float()
        cross = torch.zeros((1, n, N_FEATURES)) if model.pair_features else None  # computed outside the head
        with FlopCounterMode(display=False) as counter:
            model.score(state, stored, text, cross)
    return counter.get_total_flops() / n
