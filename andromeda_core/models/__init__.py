"""Retrieval models. A Scorer has an ad tower (`encode_ads`, run at publish time, stored in the
index), user towers (`encode_users`, once per request) and a pairwise `score` the scan applies.
It runs on its `device` (that of the ad table it scores): user state is built there, `score` takes
ads there, and only `encode_ads` returns CPU tensors (the publisher serialises them).

- two_tower.HashedTwoTower: dot product of hashed-content towers (untrained content baseline).
- serving.ModelScorer: a trained RetrievalModel (MoE or a baseline head) behind this interface.
- towers / heads / retrieval: the trained models; recdata / train / evaluate / quality: their data,
  training and offline quality report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from andromeda_core.types import Ad, RetrieveRequest

EmbeddingLookup = Callable[[Sequence[int]], tuple[torch.Tensor, torch.Tensor]]
"""ad ids (n,) -> (stored vectors (n, D) float32, zeros where not indexed; found (n,) bool)."""


@dataclass(frozen=True)
class KernelHead:
    """A scorer's head as the fused kernels apply it (kernels.reference.fused) for B requests: experts
    (B, E, D) float32, keys (B, E, G) float32 (scaled so that keys . q is the gating logit), mask (B, E)
    bool, bias_col: the stored vector's bias column (-1: none), top_n experts per candidate. The dot
    product is E = 1, G = 0."""

    experts: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    bias_col: int
    top_n: int


def find_sorted(keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys (V,) ascending, queries (...) -> (rows (...) int64 into keys, found (...) bool: keys[rows] == queries).
    Rows where not found are valid indices (any row), so gathering with them needs no masking first."""
    if not len(keys):
        return torch.zeros(queries.shape, dtype=torch.int64, device=queries.device), \
            torch.zeros(queries.shape, dtype=torch.bool, device=queries.device)
    rows = torch.searchsorted(keys, queries.to(keys.device)).clamp(max=len(keys) - 1)
    return rows, keys[rows] == queries.to(keys.device)


def dot_head(users: torch.Tensor, bias_col: int) -> KernelHead:
    """A dot-product head: users (B, D)."""
    B = users.shape[0]
    return KernelHead(users.float()[:, None, :], users.new_zeros((B, 1, 0), dtype=torch.float32),
                      torch.ones((B, 1), dtype=torch.bool, device=users.device), bias_col, 1)


class Scorer(Protocol):
    name: str  # model tag stored with every stream entry and snapshot: embeddings of one model only
    dim: int
    device: torch.device  # where the model runs; built with device=..., moved with to()

    def to(self, device: str | torch.device) -> "Scorer":
        """Move the model to `device` in place; returns self."""

    def encode_ads(self, ads: Sequence[Ad]) -> torch.Tensor:
        """(n, D) float32 ad embeddings on the CPU, as stored in the index (the tower runs on the device)."""

    def encode_users(self, requests: Sequence[RetrieveRequest], lookup: EmbeddingLookup, now: Sequence[int]) -> Any:
        """Per-request user state on the device, consumed by `score` (run once per request); now (B,)
        seconds. users[b:b + 1] is the state of request b alone, users.to(device) moves it, and it
        pickles (it travels between Ray actors)."""

    def score(self, users: Any, ads: torch.Tensor) -> torch.Tensor:
        """users for B requests, ads (n, D) on the device -> (B, n) float32 scores on the device."""

    def kernel_head(self, users: Any) -> KernelHead:
        """`score` as the fused kernels take it; they shortlist with it, and the shortlist is rescored with it in
        float64 (retriever.exact_scores)."""


def score_each(score: Callable[[Any, torch.Tensor], torch.Tensor], users: Any, candidates: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
    """Each request against its own valid candidates: candidates (B, m, D), valid (B, m) bool -> (B, m) float32
    scores, 0 where not valid. A request's valid candidates are scored by themselves, the call it makes alone, so
    its scores do not depend on how many places its batch mates padded it to: a matmul's rounding may change
    with its shape (on an AVX-512 Xeon, a dot product of 16 dims came out 1.0000001 among 26 candidates and
    1.0 among 2). The mask is read on the host, and each request's valid places go back to the device, once for
    the batch: indexing by a device mask, or copying a request's places, waits on the device per request."""
    out = torch.zeros(candidates.shape[:2], device=candidates.device)
    valid = valid.cpu()
    places = torch.argsort((~valid).to(torch.int8), dim=1, stable=True).to(candidates.device)  # valid places first
    for b, count in enumerate(valid.sum(1).tolist()):
        if count:
            kept = places[b, :count]
            out[b, kept] = score(users[b:b + 1], candidates[b, kept])[0].float()
    return out
