"""Ad tower and user expert towers of the retrieval models.

Stored ad vector (S = D + G + M + 1): [a (D) ad embedding | q (G) gating query | s (M) unit-norm
semantic projection of the creative's MiniLM text embedding | b (1) ad bias]. The index stores it;
user towers read the stored vectors of the ads a user engaged with, so serving needs no other per-ad data.

Item identity: a and b are content (MiniLM text, category, advertiser, bid) plus a learned residual per
ad id engaged often enough in training (TrainConfig.min_id_engagements), started from co-engagement
(identity.co_engagement_start). An ad the model has no id row for
(created after training, or rarer) gets the content part alone; training drops each ad's id row with some
probability (`id_dropout`), so the content tower learns to stand in for the id (the fallback is
content-only, not hashing). a also adds a linear map (started as the identity) of the mean of the user towers'
segment embeddings of the described values its text mentions (segments.mentions: an ad naming "yoga" sits near the
users who declare yoga; a new ad has its mentions too).

User experts (E = interests + 4), each an embedding u_e (D) and a gating key k_e (G):
  sequence expert: causal self-attention (SASRec style) over the engagement sequence, read at its
                   most recent position; tokens = stored vector + event + position + time gap,
  interests experts: attention of learned interest queries over the same contextualised sequence,
  segment expert: mean of the embeddings of the user's segments (cohort ids and declared attribute
                  values, hashed: andromeda_core.models.segments) plus a projection of the mean MiniLM
                  text of its described values (interests, behaviours: segments.described_table, held
                  in the towers, so serving needs no text model),
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

from andromeda_core.models import find_sorted
from andromeda_core.models.segments import MENTIONS
from andromeda_core.models.text import TEXT_DIM
from andromeda_core.wire import NumpyPickled

N_EVENTS = 6
GAP_BUCKETS = 24  # log2-spaced buckets of hours between engagements (and since the last one)


@dataclass(frozen=True)
class Dims:
    dim: int = 64  # D
    gate: int = 16  # G
    semantic: int = 32  # M
    interests: int = 2  # interest experts
    categories: int = 64
    advertiser_buckets: int = 4096
    segment_buckets: int = 8192
    surfaces: int = 16
    placements: int = 32
    history: int = 50  # most recent engagements the user towers read
    click_weight: float = 2.0  # weight of an ad's click log-odds (RetrievalModel.click_prior) in its bias
    click_smoothing: float = 2.0  # impressions the click log-odds were smoothed by (RecData.click_logodds; a record)
    deep_scale: float = 1.0  # a ranker's: the scale its trained deep part was kept at (train.scale_deep_part; a record)
    mentions: int = MENTIONS  # described values per ad whose segment embeddings the ad tower adds (segments.mentions;
    # 0 when trained on items that keep no text, MovieLens's, so serving adds none either)
    layers: int = 2  # self-attention blocks of the sequence expert
    heads: int = 2

    @property
    def stored(self) -> int:
        return self.dim + self.gate + self.semantic + 1

    @property
    def experts(self) -> int:
        return self.interests + 4

    def bias(self, stored: torch.Tensor) -> torch.Tensor:
        """(n, S) stored vectors -> (n,) ad biases."""
        return stored[:, -1].float()

    @staticmethod
    def features(stored: torch.Tensor) -> torch.Tensor:
        """(..., S) stored vectors -> (..., S - 1): all but the bias, which only the score adds (it carries the
        click prior, set after training: RetrievalModel.click_prior)."""
        return stored[..., :-1]


class Tensors(NumpyPickled):
    """Base of the dataclasses of tensors below: moved to a device as one; pickled as numpy arrays (a user state
    travels from the router to the shards)."""

    def to(self, device: str | torch.device):
        """The same fields on `device` (no copy of those already there)."""
        return type(self)(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class UserInputs(Tensors):
    """hist (B, L, S) stored vectors of engaged ads, oldest first, padded at the end; hist_event (B, L)
    int64, hist_age (B, L) hours before the request, hist_mask (B, L); segments (B, C) int64 hashed ids
    (mask (B, C)); co (B, M, S) with co_mask (B, M); context (B, 3) int64 surface+1, placement+1
    (0 = unknown), hour."""

    hist: torch.Tensor
    hist_event: torch.Tensor
    hist_age: torch.Tensor
    hist_mask: torch.Tensor
    segments: torch.Tensor
    segment_mask: torch.Tensor
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


BID_FEATURE_MAX = 1000.0  # bids above it read as it: the tower never trains on such bids (the synthetic worlds' stay
# under 100, MovieLens's is constant), and unbounded, log1p(3.4e38) = 88 put one ad above every other for every user


class AdTower(nn.Module):
    """Content tower plus learned per-id residuals for `ids` ads ((ids + 1, D + 1) table: embedding and
    bias; the last row, zero and never trained, stands for "no id")."""

    def __init__(self, d: Dims, ids: int = 0):
        super().__init__()
        self.d = d
        self.text = nn.Linear(TEXT_DIM, 128)
        self.category = nn.Embedding(d.categories, 32)
        self.advertiser = nn.Embedding(d.advertiser_buckets, 16)
        self.mlp = nn.Sequential(nn.Linear(128 + 32 + 16 + 1, 128), nn.GELU(), nn.Linear(128, d.dim + d.gate + 1))
        self.semantic = nn.Linear(TEXT_DIM, d.semantic)
        self.identity = nn.Embedding(ids + 1, d.dim + 1, padding_idx=ids)  # last row: no id (content only)
        nn.init.normal_(self.identity.weight, std=0.01)
        with torch.no_grad():
            self.identity.weight[ids] = 0
        self.mentioned = nn.Parameter(torch.eye(d.dim))  # (D, D) map of the user towers' segment embeddings,
        # started as the identity (and drawing no random numbers: every other weight starts as before it)

    def forward(self, text: torch.Tensor, category: torch.Tensor, advertiser: torch.Tensor, bid: torch.Tensor,
                id_rows: torch.Tensor, mentioned: torch.Tensor) -> torch.Tensor:
        """text (N, 384), category/advertiser (N,) int64, bid (N,), id_rows (N,) int64 (-1: no id), mentioned
        (N, D): the mean segment embedding of the described values its text mentions (0 for none) -> (N, S)."""
        d, text = self.d, text.float()
        h = torch.cat([F.gelu(self.text(text)), self.category(category.clamp(0, d.categories - 1)),
                       self.advertiser(advertiser % d.advertiser_buckets),
                       torch.log1p(bid.clamp(0, BID_FEATURE_MAX))[:, None]], 1)
        out = self.mlp(h)
        no_id = self.identity.num_embeddings - 1
        ident = self.identity(torch.where((id_rows >= 0) & (id_rows < no_id), id_rows, no_id))
        a = out[:, : d.dim] + ident[:, : d.dim] + mentioned @ self.mentioned
        bias = out[:, -1:] + ident[:, -1:]
        return torch.cat([a, out[:, d.dim: d.dim + d.gate], F.normalize(self.semantic(text), dim=1), bias], 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (B, L, F), mask (B, L) -> (B, F); zeros where nothing is masked in."""
    w = mask.float()[..., None]
    return (x * w).sum(1) / w.sum(1).clamp(min=1)


def gap_buckets(hours: torch.Tensor) -> torch.Tensor:
    """(...) non-negative hours -> (...) int64 log2 buckets in [0, GAP_BUCKETS)."""
    return torch.log2(hours.clamp(min=0) + 1).floor().long().clamp(max=GAP_BUCKETS - 1)


class CausalBlock(nn.Module):
    """Pre-norm transformer block over (B, L, D): x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))),
    attention causal. Dropout only on the two residual branches: on CPU it costs about 10 ns an element, and
    nn.TransformerEncoderLayer's two more sites (the (B, H, L, L) attention weights and the MLP's hidden layer)
    took a fifth of a training step on MovieLens."""

    def __init__(self, d: Dims, dropout: float = 0.1):
        super().__init__()
        self.heads, self.dropout = d.heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(d.dim), nn.LayerNorm(d.dim)
        self.qkv, self.attention_out = nn.Linear(d.dim, 3 * d.dim), nn.Linear(d.dim, d.dim)
        self.mlp = nn.Sequential(nn.Linear(d.dim, 2 * d.dim), nn.GELU(), nn.Linear(2 * d.dim, d.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        x = x + F.dropout(self.attention_out(attended), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class SequenceEncoder(nn.Module):
    """Causal self-attention over engagements (SASRec/HSTU style, pre-norm blocks).

    tokens (B, L, D), mask (B, L) bool (real engagements first, padding after) -> (B, L, D): position i
    sees positions <= i only, so a later engagement cannot change an earlier position's output (and no real
    engagement sees the padding after it)."""

    def __init__(self, d: Dims):
        super().__init__()
        self.blocks = nn.ModuleList(CausalBlock(d) for _ in range(d.layers))
        self.norm = nn.LayerNorm(d.dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = tokens
        for block in self.blocks:
            x = block(x)
        return self.norm(x) * mask[..., None]


class UserTowers(nn.Module):
    """described: the number of described values whose text the segment expert reads (buffers
    described_hashes (V,) int64 ascending and described_text (V, 384) float16: segments.described_table)."""

    def __init__(self, d: Dims, described: int = 0):
        super().__init__()
        self.d = d
        D, S = d.dim, d.stored
        self.register_buffer("described_hashes", torch.zeros(described, dtype=torch.int64))
        self.register_buffer("described_text", torch.zeros((described, TEXT_DIM), dtype=torch.float16))
        self.described_out = nn.Sequential(nn.Linear(TEXT_DIM, 128), nn.GELU(), nn.Linear(128, D))
        self.item = nn.Linear(S - 1, D)  # Dims.features: the bias is the score's alone
        self.event = nn.Embedding(N_EVENTS, D)
        self.position = nn.Embedding(d.history, D)  # 0 = most recent
        self.gap = nn.Embedding(GAP_BUCKETS, D)  # hours since the previous engagement
        self.age = nn.Embedding(GAP_BUCKETS, D)  # hours before the request
        self.sequence = SequenceEncoder(d)
        self.empty = nn.Parameter(torch.zeros(D))  # the sequence expert of a user with no history
        self.interest_queries = nn.Parameter(torch.randn(d.interests, D) / D**0.5)
        self.interest_out = nn.Linear(D, D)
        self.segment = nn.EmbeddingBag(d.segment_buckets, D, mode="sum")
        self.semantic_query = nn.Linear(d.semantic, 1)
        self.semantic_out = nn.Sequential(nn.Linear(d.semantic, D), nn.GELU(), nn.Linear(D, D))
        self.co_out = nn.Sequential(nn.Linear(S - 1, D), nn.GELU(), nn.Linear(D, D))
        self.surface = nn.Embedding(d.surfaces, D)
        self.placement = nn.Embedding(d.placements, D)
        self.hour = nn.Embedding(24, D)
        self.context_gain = nn.Linear(D, D)
        self.keys = nn.Linear(D, d.gate)
        self.expert_bias = nn.Parameter(torch.zeros(d.experts, D))

    def tokens(self, x: UserInputs) -> torch.Tensor:
        """(B, L, D) input tokens: stored vector + event + position from the end + time gap + age."""
        n = x.hist_mask.sum(1, keepdim=True)
        steps = torch.arange(x.hist.shape[1], device=x.hist.device)[None]
        position = (n - 1 - steps).clamp(0, self.d.history - 1)
        previous = torch.cat([x.hist_age[:, :1], x.hist_age[:, :-1]], 1)
        return (self.item(self.d.features(x.hist)) + self.event(x.hist_event) + self.position(position)
                + self.gap(gap_buckets(previous - x.hist_age)) + self.age(gap_buckets(x.hist_age)))

    def segment_mean(self, segments: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """segments (B, C) hashed ids, mask (B, C) -> (B, D): the mean of their embeddings; 0 for a row with none."""
        if not segments.shape[1]:
            return self.segment.weight.new_zeros((len(segments), self.d.dim))
        weights = mask.float() / mask.float().sum(1, keepdim=True).clamp(min=1)
        return self.segment(segments.clamp(min=0) % self.d.segment_buckets, per_sample_weights=weights)

    def described(self, segments: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """segments (B, C) hashed ids, mask (B, C) -> (B, D): the projection of the mean text of the described
        values among them; 0 for a user with none."""
        if not len(self.described_hashes) or not segments.shape[1]:
            return self.described_text.new_zeros((len(segments), self.d.dim), dtype=torch.float32)
        rows, found = find_sorted(self.described_hashes, segments)
        found = found & mask
        summed = torch.einsum("bc,bcf->bf", found.float(), self.described_text[rows].float())
        count = found.sum(1, keepdim=True)
        return self.described_out(summed / count.clamp(min=1)) * (count > 0)

    def forward(self, x: UserInputs) -> UserState:
        d = self.d
        B = x.hist.shape[0]
        has_hist = x.hist_mask.any(1)
        # Sequence expert: the causal encoder's output at the most recent engagement.
        seq = self.sequence(self.tokens(x), x.hist_mask)  # (B, L, D)
        last = (x.hist_mask.sum(1) - 1).clamp(min=0)
        sequence = torch.where(has_hist[:, None], seq[torch.arange(B), last], self.empty)
        # Interest experts: learned queries attend over the contextualised sequence.
        logits = torch.einsum("id,bld->bil", self.interest_queries, seq) / d.dim**0.5
        logits = logits.masked_fill(~x.hist_mask[:, None, :], float("-inf"))
        attn = torch.nan_to_num(torch.softmax(logits, -1))  # rows with no history are all zeros
        interests = self.interest_out(torch.einsum("bil,bld->bid", attn, seq))
        # Segment expert.
        segment = self.segment_mean(x.segments, x.segment_mask) + self.described(x.segments, x.segment_mask)
        # Semantic expert: attention-pooled semantic parts of engaged ads.
        sem = x.hist[..., d.dim + d.gate: d.dim + d.gate + d.semantic]
        sem_logits = self.semantic_query(sem).squeeze(-1).masked_fill(~x.hist_mask, float("-inf"))
        sem_pool = torch.einsum("bl,blm->bm", torch.nan_to_num(torch.softmax(sem_logits, -1)), sem)
        semantic = self.semantic_out(sem_pool)
        co = self.co_out(masked_mean(self.d.features(x.co), x.co_mask))
        experts = torch.cat([sequence[:, None], interests, segment[:, None], semantic[:, None], co[:, None]], 1) \
            + self.expert_bias
        mask = torch.stack([torch.ones_like(has_hist)] + [has_hist] * d.interests
                           + [x.segment_mask.any(1), has_hist, x.co_mask.any(1)], 1)
        context = self.surface(x.context[:, 0]) + self.placement(x.context[:, 1]) + self.hour(x.context[:, 2] % 24)
        experts = experts * (1 + torch.tanh(self.context_gain(context)))[:, None, :]
        return UserState(experts, self.keys(experts), mask)
