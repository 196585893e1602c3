"""Reference exact top-k: order by score descending, then ad id ascending (replica-independent)."""
from __future__ import annotations

import torch

NO_ID = -1


def ranked_scores(scores: torch.Tensor) -> torch.Tensor:
    """scores as float32 with NaN as -inf (how every top-k here ranks them); infinities stay infinite."""
    return scores.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def topk_by_score_then_id(scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, m) float, ids (B, m) int64, valid (B, m) bool -> (ids (B, k), scores (B, k)).

    Only valid entries are returned; missing places hold id -1 and score -inf. NaN scores rank as -inf.
    """
    B, m = scores.shape
    scores = ranked_scores(scores).masked_fill(~valid, float("-inf"))
    if k < m:
        # Keep every entry tied with the k-th score so the id tie-break below sees all of them.
        threshold = scores.topk(k, dim=1).values[:, -1:]
        keep = valid & (scores >= threshold)
        width = int(keep.sum(1).max())
        order = torch.argsort(keep.to(torch.int8), dim=1, descending=True, stable=True)[:, :width]
        scores, ids, valid = scores.gather(1, order), ids.gather(1, order), keep.gather(1, order)
    valid_first = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # so that the stable sorts below keep a
    scores, ids, valid = scores.gather(1, valid_first), ids.gather(1, valid_first), valid.gather(1, valid_first)  # valid
    id_key = torch.where(valid, ids, torch.iinfo(torch.int64).max)  # id of 2**63 - 1 ahead of the invalid's equal key
    by_id = torch.argsort(id_key, dim=1, stable=True)
    scores, id_key, valid = scores.gather(1, by_id), id_key.gather(1, by_id), valid.gather(1, by_id)
    by_score = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    out_ids = torch.where(valid.gather(1, by_score), id_key.gather(1, by_score), NO_ID)
    out_scores = scores.gather(1, by_score).masked_fill(out_ids == NO_ID, float("-inf"))
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = torch.cat([out_ids, out_ids.new_full((B, pad), NO_ID)], 1)
        out_scores = torch.cat([out_scores, out_scores.new_full((B, pad), float("-inf"))], 1)
    return out_ids, out_scores

