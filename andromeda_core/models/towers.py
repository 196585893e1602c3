"""Ad tower and user expert towers of the retrieval models.

Stored ad vector (S = D + G + M): [a (D) unit-norm ad embedding | q (G) gating query | s (M) unit-norm
semantic projection of the creative's MiniLM text embedding]. The index stores it; user towers read
the stored vectors of the ads a user engaged with, so serving needs no other per-ad data.

User experts (E = interests + 3), each an embedding u_e (D) and a gating key k_e (G):
  interests x sequence expert: attention of learned interest queries over recent engagements
                               (stored vector + event type + recency),
  cohort expert: mean of hashed cohort-id embeddings,
  semantic expert: attention-pooled semantic parts (s) of the engaged ads,
  co-engagement expert: pooled stored vectors of ads engaged on other surfaces.
The serving context (surface, placement, hour) modulates every expert once per request:
u_e * (1 + tanh(W c)), so no per-ad work depends on the context.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from andromeda_core.models.text import TEXT_DIM

N_EVENTS = 6


@dataclass(frozen=True)
class Dims:
    dim: int = 64  # D
    gate: int = 16  # G
    semantic: int = 32  # M
    interests: int = 3  # sequence experts
    categories: int = 64
    advertiser_buckets: int = 4096
    cohort_buckets: int = 4096
    surfaces: int = 16
    placements: int = 32

    @property
    def stored(self) -> int:
        return self.dim + self.gate + self.semantic

    @property
    def experts(self) -> int:
        return self.interests + 3


class Tensors:
    """Base of the dataclasses of tensors below: moved to a device as one."""

    def to(self, device: str | torch.device):
        """The same fields on `device` (no copy of those already there)."""
        return type(self)(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class UserInputs(Tensors):
    """hist (B, L, S) stored vectors of engaged ads, hist_event (B, L) int64, hist_age (B, L) hours,
    hist_mask (B, L); cohorts (B, C) int64 bucket (mask (B, C)); co (B, M, S) with co_mask (B, M);
    context (B, 3) int64 surface+1, placement+1 (0 = unknown), hour."""

    hist: torch.Tensor
    hist_event: torch.Tensor
    hist_age: torch.Tensor
    hist_mask: torch.Tensor
    cohorts: torch.Tensor
    cohort_mask: torch.Tensor
    co: torch.Tensor
    co_mask: torch.Tensor
    context: torch.Tensor


@dataclass
class UserState(Tensors):
    """experts (B, E, D), keys (B, E, G), mask (B, E) bool: which experts have input. Picklable (it
    travels between Ray actors); users[b:b + 1] is request b's state, users.to(device) moves it."""

    experts: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor

    def __getitem__(self, rows: slice) -> "UserState":
        return UserState(self.experts[rows], self.keys[rows], self.mask[rows])


class AdTower(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.text = nn.Linear(TEXT_DIM, 128)
        self.category = nn.Embedding(d.categories, 32)
        self.advertiser = nn.Embedding(d.advertiser_buckets, 16)
        self.mlp = nn.Sequential(nn.Linear(128 + 32 + 16 + 1, 128), nn.GELU(), nn.Linear(128, d.dim + d.gate))
        self.semantic = nn.Linear(TEXT_DIM, d.semantic)

    def forward(self, text: torch.Tensor, category: torch.Tensor, advertiser: torch.Tensor, bid: torch.Tensor) -> torch.Tensor:
        """text (N, 384), category/advertiser (N,) int64, bid (N,) -> stored vectors (N, S)."""
        text = text.float()
        h = torch.cat([F.gelu(self.text(text)), self.category(category.clamp(0, self.d.categories - 1)),
                       self.advertiser(advertiser % self.d.advertiser_buckets), torch.log1p(bid.clamp(min=0))[:, None]], 1)
        out = self.mlp(h)
        a, q = F.normalize(out[:, : self.d.dim], dim=1), out[:, self.d.dim:]
        return torch.cat([a, q, F.normalize(self.semantic(text), dim=1)], 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (B, L, F), mask (B, L) -> (B, F); zeros where nothing is masked in."""
    w = mask.float()[..., None]
    return (x * w).sum(1) / w.sum(1).clamp(min=1)


class UserTowers(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        D, S = d.dim, d.stored
        self.item = nn.Linear(S, D)
        self.event = nn.Embedding(N_EVENTS, D)
        self.recency = nn.Linear(1, D)
        self.interest_queries = nn.Parameter(torch.randn(d.interests, D) / D**0.5)
        self.interest_out = nn.Linear(D, D)
        self.cohort = nn.EmbeddingBag(d.cohort_buckets, D, mode="sum")
        self.semantic_query = nn.Linear(d.semantic, 1)
        self.semantic_out = nn.Sequential(nn.Linear(d.semantic, D), nn.GELU(), nn.Linear(D, D))
        self.co_out = nn.Sequential(nn.Linear(S, D), nn.GELU(), nn.Linear(D, D))
        self.surface = nn.Embedding(d.surfaces, D)
        self.placement = nn.Embedding(d.placements, D)
        self.hour = nn.Embedding(24, D)
        self.context_gain = nn.Linear(D, D)
        self.keys = nn.Linear(D, d.gate)
        self.expert_bias = nn.Parameter(torch.zeros(d.experts, D))

    def forward(self, x: UserInputs) -> UserState:
        d = self.d
        B = x.hist.shape[0]
        # Sequence experts: interest queries attend over engagements (item + event + recency).
        tokens = self.item(x.hist) + self.event(x.hist_event) + self.recency(torch.log1p(x.hist_age.clamp(min=0))[..., None])
        logits = torch.einsum("id,bld->bil", self.interest_queries, tokens) / d.dim**0.5
        logits = logits.masked_fill(~x.hist_mask[:, None, :], float("-inf"))
        attn = torch.nan_to_num(torch.softmax(logits, -1))  # rows with no history are all zeros
        interests = self.interest_out(torch.einsum("bil,bld->bid", attn, tokens))
        # Cohort expert.
        cohorts = x.cohorts.clamp(min=0) % d.cohort_buckets
        weights = x.cohort_mask.float() / x.cohort_mask.float().sum(1, keepdim=True).clamp(min=1)
        cohort = self.cohort(cohorts, per_sample_weights=weights) if cohorts.shape[1] \
            else x.hist.new_zeros((B, d.dim))
        # Semantic expert: attention-pooled semantic parts of engaged ads.
        sem = x.hist[..., d.dim + d.gate:]
        sem_logits = self.semantic_query(sem).squeeze(-1).masked_fill(~x.hist_mask, float("-inf"))
        sem_pool = torch.einsum("bl,blm->bm", torch.nan_to_num(torch.softmax(sem_logits, -1)), sem)
        semantic = self.semantic_out(sem_pool)
        co = self.co_out(masked_mean(x.co, x.co_mask))
        experts = torch.cat([interests, cohort[:, None], semantic[:, None], co[:, None]], 1) + self.expert_bias
        has_hist = x.hist_mask.any(1)
        mask = torch.stack([has_hist] * d.interests + [x.cohort_mask.any(1), has_hist, x.co_mask.any(1)], 1)
        mask[:, 0] = True  # the first interest expert always answers (its bias covers empty histories)
        context = self.surface(x.context[:, 0]) + self.placement(x.context[:, 1]) + self.hour(x.context[:, 2] % 24)
        experts = experts * (1 + torch.tanh(self.context_gain(context)))[:, None, :]
        return UserState(experts, self.keys(experts), mask)
