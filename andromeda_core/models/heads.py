"""Interaction heads: how a user state meets a candidate's stored vector (S = D + G + M).

- MoEHead: attention-based mixture of logits. The candidate's gating query q attends over the user
  experts' keys; the top-n experts (of E) get softmax gates; score = sum_e gate_e * <u_e, a>.
- DotHead (two-tower): one user vector (learned mix of the experts) . a.
- DenseHead (the pre-MoE dense interaction retriever): MLP([u, a, u * a]).
- RankerHead (quality ceiling, not served): deep MLP over every expert, the full stored vector, the
  expert-ad products and the ad's text projection.
Every head: score(state, stored (n, S), text (n, 384) or None) -> (B, n) and flops_per_pair().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from andromeda_core.models.text import TEXT_DIM
from andromeda_core.models.towers import Dims, UserState


class MoEHead(nn.Module):
    def __init__(self, d: Dims, top_n: int = 2):
        super().__init__()
        self.d, self.top_n = d, min(top_n, d.experts)

    def gates(self, state: UserState, q: torch.Tensor) -> torch.Tensor:
        """(B, E, n) gates: softmax over each candidate's top-n experts by key . query, zero elsewhere."""
        logits = torch.einsum("beg,ng->ben", state.keys, q.float()) / self.d.gate**0.5
        logits = logits.masked_fill(~state.mask[:, :, None], float("-inf"))
        top = logits.topk(self.top_n, dim=1)
        chosen = torch.full_like(logits, float("-inf")).scatter(1, top.indices, top.values)
        return torch.nan_to_num(torch.softmax(chosen, dim=1))  # fewer than n usable experts: zero gates

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        a, q = stored[:, : self.d.dim].float(), stored[:, self.d.dim: self.d.dim + self.d.gate]
        sims = torch.einsum("bed,nd->ben", state.experts, a)
        return (self.gates(state, q) * sims).sum(1)

    def flops_per_pair(self) -> int:
        E, D, G, n = self.d.experts, self.d.dim, self.d.gate, self.top_n
        return 2 * E * G + 2 * E * D + E * n + 4 * n + 2 * n  # gating logits, sims, top-n, softmax, gated sum


def _user_vector(mix: nn.Linear, state: UserState) -> torch.Tensor:
    experts = state.experts * state.mask[..., None]
    return mix(experts.flatten(1))


class DotHead(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.mix = nn.Linear(d.experts * d.dim, d.dim)

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        return _user_vector(self.mix, state) @ stored[:, : self.d.dim].float().T

    def flops_per_pair(self) -> int:
        return 2 * self.d.dim


class DenseHead(nn.Module):
    def __init__(self, d: Dims, hidden: int = 128):
        super().__init__()
        self.d, self.hidden = d, hidden
        self.mix = nn.Linear(d.experts * d.dim, d.dim)
        self.mlp = nn.Sequential(nn.Linear(3 * d.dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        u = _user_vector(self.mix, state)[:, None, :].expand(-1, stored.shape[0], -1)
        a = stored[None, :, : self.d.dim].float().expand(u.shape[0], -1, -1)
        return self.mlp(torch.cat([u, a, u * a], -1)).squeeze(-1)

    def flops_per_pair(self) -> int:
        D, H = self.d.dim, self.hidden
        return D + 2 * 3 * D * H + H + 2 * H  # product, layer 1, activation, layer 2


class RankerHead(nn.Module):
    def __init__(self, d: Dims, hidden: tuple[int, int] = (512, 256)):
        super().__init__()
        self.d, self.hidden = d, hidden
        self.text = nn.Linear(TEXT_DIM, d.dim)
        width = 2 * d.experts * d.dim + d.stored + d.dim
        self.width = width
        self.mlp = nn.Sequential(nn.Linear(width, hidden[0]), nn.GELU(), nn.Linear(hidden[0], hidden[1]), nn.GELU(),
                                 nn.Linear(hidden[1], 1))

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        B, n = state.experts.shape[0], stored.shape[0]
        experts = state.experts * state.mask[..., None]  # (B, E, D)
        a = stored[:, : self.d.dim].float()
        products = torch.einsum("bed,nd->bned", experts, a).flatten(2)  # (B, n, E*D)
        ad = torch.cat([stored.float(), self.text(text.float())], 1)  # per ad, not per pair
        pair = torch.cat([experts.flatten(1)[:, None, :].expand(B, n, -1), products, ad[None].expand(B, -1, -1)], -1)
        return self.mlp(pair).squeeze(-1)

    def flops_per_pair(self) -> int:
        E, D = self.d.experts, self.d.dim
        h1, h2 = self.hidden
        return E * D + 2 * self.width * h1 + h1 + 2 * h1 * h2 + h2 + 2 * h2


HEADS = {"moe": MoEHead, "two_tower": DotHead, "dense": DenseHead, "ranker": RankerHead}
