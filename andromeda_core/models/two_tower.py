"""Two-tower dot-product baseline over hashed content tokens.

Ad tower: sum of token vectors of the creative's title, body and category, L2-normalised.
User tower: normalised sum of the interest/behaviour tokens the user holds plus the mean stored
embedding of the ads they engaged with. Token vectors come from a seeded table (trainable later).
The table lives on `device`: user vectors are built there and score takes ads there; encode_ads
returns CPU float32 (what the publisher stores).
"""
from __future__ import annotations

import re
import zlib
from typing import Sequence

import torch
import torch.nn.functional as F

from andromeda_core.models import EmbeddingLookup, KernelHead, dot_head
from andromeda_core.schema import Schema, attribute_values
from andromeda_core.types import Ad, HistoryEvent, RetrieveRequest

TOKEN = re.compile(r"[a-z0-9]+")
POSITIVE_EVENTS = frozenset({"click", "like", "share", "conversion"})
CLOCK_SKEW_S = 60  # how far past the server's clock a request without context.ts still reads its history
USER_TEXT_CATEGORIES = ("interests", "behaviors", "life_events")


def engagements_as_of(r: RetrieveRequest, now: int) -> list[HistoryEvent]:
    """The request's engagements (POSITIVE_EVENTS) up to its time `now`, oldest first (equal ts in the order
    given): a later one had not happened as of now, so it is not read (training's histories end before their
    target too). A request without context.ts is answered at the server's clock, which another machine's may
    run ahead of: its entries up to CLOCK_SKEW_S past it are read as well."""
    last = now + (CLOCK_SKEW_S if r.context.ts is None else 0)
    return sorted((h for h in r.user.history if h.event in POSITIVE_EVENTS and h.ts <= last), key=lambda h: h.ts)


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


class HashedTwoTower:
    name = "hashed_two_tower"

    def __init__(self, dim: int = 64, buckets: int = 1 << 16, seed: int = 0, device: str | torch.device = "cpu",
                 schema: Schema | None = None):
        """schema: the user's values outside its vocabularies are left out, as targeting leaves them (without one,
        every value's words count)."""
        generator = torch.Generator().manual_seed(seed)
        self.dim, self.buckets, self.schema = dim, buckets, schema
        self.table = torch.randn(buckets, dim, generator=generator) / dim**0.5  # drawn on the CPU: same on every device
        self.to(device)

    def to(self, device: str | torch.device) -> "HashedTwoTower":
        """Move the token table to `device` (in place); returns self."""
        self.device = torch.device(device)
        self.table = self.table.to(self.device)
        return self

    def _embed(self, token_lists: Sequence[list[str]]) -> torch.Tensor:
        """(n, D) normalised sum of hashed token vectors (zeros for no tokens), on the device."""
        ids = [zlib.crc32(t.encode()) % self.buckets for tokens in token_lists for t in tokens]
        offsets = torch.tensor([0] + [len(t) for t in token_lists[:-1]], device=self.device).cumsum(0)
        bags = F.embedding_bag(torch.tensor(ids, dtype=torch.int64, device=self.device), self.table, offsets, mode="sum")
        return F.normalize(bags, dim=1)

    def encode_ads(self, ads: Sequence[Ad]) -> torch.Tensor:
        """-> (n, D) float32 on the CPU."""
        return self._embed([tokenize(f"{a.creative.title} {a.creative.body} {a.creative.category}") for a in ads]).cpu()

    def _values(self, r: RetrieveRequest) -> list[str]:
        """The user's interest, behaviour and life-event values, each once (and with a schema, those of its
        vocabularies: an unknown value, which targeting says matches nothing, moved every score)."""
        words = []
        for category in USER_TEXT_CATEGORIES:
            value = r.user.attributes.get(category)
            known = self.schema.by_name.get(category) if self.schema is not None else None
            words += [v for v in attribute_values(value) if isinstance(v, str)
                      and (known is None or known.value_index(v) is not None)]
        return list(dict.fromkeys(words))

    def encode_users(self, requests: Sequence[RetrieveRequest], lookup: EmbeddingLookup,
                     now: Sequence[int]) -> torch.Tensor:
        """B requests, now (B,) seconds -> (B, D) user embeddings on the device."""
        content = self._embed([[t for w in self._values(r) for t in tokenize(w)] for r in requests])
        history = torch.zeros_like(content)
        for b, r in enumerate(requests):
            engaged, found = lookup([h.ad_id for h in engagements_as_of(r, now[b])])
            if found.any():
                history[b] = F.normalize(engaged[found].mean(0), dim=0)  # copied onto the device
        return F.normalize(content + history, dim=1)

    def score(self, users: torch.Tensor, ads: torch.Tensor) -> torch.Tensor:
        """users (B, D), ads (n, D), both on the device -> (B, n) float32 scores."""
        return users @ ads.float().T

    def kernel_head(self, users: torch.Tensor) -> KernelHead:
        return dot_head(users, bias_col=-1)
