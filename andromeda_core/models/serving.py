"""A trained RetrievalModel behind the retriever's Scorer interface.

encode_ads runs the ad tower (MiniLM text embedding of title and body, the described values they mention,
creative category, advertiser, bid, and the ad's learned identity when the model was trained on its id; content alone
for an ad created after training) at publish time; the index stores its (S,) output. encode_users runs the user
towers once per request on the stored vectors of the ads in the user's history and cross-surface
engagements (looked up in the index), the segments (cohorts and declared attributes) and the serving context. score applies the head.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from andromeda_core.errors import InvalidInput
from andromeda_core.models import EmbeddingLookup, KernelHead
from andromeda_core.models.recdata import EVENTS
from andromeda_core.models.retrieval import CO_ITEMS, RetrievalModel, served_name
from andromeda_core.models.segments import SEGMENTS, mentions, segment_ids
from andromeda_core.models.text import encode_texts
from andromeda_core.models.towers import UserInputs, UserState
from andromeda_core.models.two_tower import engagements_as_of
from andromeda_core.schema import Schema
from andromeda_core.types import Ad, RetrieveRequest

log = logging.getLogger(__name__)


class ModelScorer:
    """The model runs on `device`: encode_users returns its UserState there and score takes ads there;
    encode_ads returns CPU float32 (what the publisher stores)."""

    def __init__(self, model: RetrievalModel, categories: Sequence[str], schema: Schema,
                 device: str | torch.device = "cpu"):
        if not hasattr(model.head, "kernel_head"):
            raise InvalidInput(f"a {model.kind} checkpoint is not served (the ranker is the offline quality "
                               "ceiling): serve a moe, two_tower or sasrec checkpoint", "model")
        self.model, self.name = model.eval(), served_name(model, categories)
        self.dim = model.dims.stored
        self.categories = {c: i for i, c in enumerate(categories)}  # unknown -> len(categories)
        self.schema, self.surface, self.placement = schema, schema.by_name.get("surface"), schema.by_name.get("placement")
        self.to(device)

    @classmethod
    def load(cls, path: str | Path, schema: Schema, device: str | torch.device = "cpu") -> "ModelScorer":
        model, config = RetrievalModel.load(path)
        if "categories" not in config:
            raise ValueError(f"{path}: checkpoint has no category vocabulary; retrain it with `andromeda train`")
        trained_under = (config.get("schema"), config.get("schema_version"), config.get("schema_fingerprint"))
        if trained_under[:2] != (schema.name, schema.version) or not schema.has_fingerprint(trained_under[2]):
            log.warning("%s was trained on data of schema %s version %s (fingerprint %s) and serves under %s version %s "
                        "(%s): it serves (segments are hashed by name), but the segment embeddings its towers learned "
                        "are of that schema's values", path, *trained_under, schema.name, schema.version,
                        schema.fingerprint)
        return cls(model, config["categories"], schema, device)

    def to(self, device: str | torch.device) -> "ModelScorer":
        """Move the model to `device` (in place); returns self."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    def warm_up(self) -> None:
        """Load the sentence model now (seconds on a CPU): the first write would otherwise pay for it inside its
        request's deadline."""
        encode_texts(["warm up"])

    @torch.no_grad()
    def encode_ads(self, ads: Sequence[Ad]) -> torch.Tensor:
        """-> (n, S) float32 stored vectors on the CPU; the ad tower runs on the device."""
        if not ads:
            return torch.zeros((0, self.dim))
        texts = [f"{a.creative.title}. {a.creative.body}" for a in ads]  # as training reads them (load_synthetic)
        text = torch.from_numpy(encode_texts(texts)).to(self.device)
        category = [self.categories.get(a.creative.category, len(self.categories)) for a in ads]
        stored = self.model.embed_ads(text, torch.tensor(category, device=self.device),
                                      torch.tensor([a.advertiser_id for a in ads], device=self.device),
                                      torch.tensor([a.bid for a in ads], dtype=torch.float32, device=self.device),
                                      torch.tensor([a.ad_id for a in ads], device=self.device),
                                      torch.from_numpy(mentions(texts, self.schema)).to(self.device))
        return stored.cpu()

    def _context(self, r: RetrieveRequest, now: int) -> list[int]:
        def index(cat, value, rows: int) -> int:
            """1 + the value's place in cat's vocabulary (of several values, the first's); 0 for unknown, and for a
            place past the checkpoint's `rows` (a schema of more values than it was trained with)."""
            if isinstance(value, list):
                value = value[0] if value else None
            i = cat.value_index(value) if cat is not None and value is not None else None
            return 0 if i is None or i + 1 >= rows else i + 1

        d = self.model.dims
        return [index(self.surface, r.context.surface, d.surfaces),
                index(self.placement, r.context.placement, d.placements), now // 3600 % 24]

    @torch.no_grad()
    def encode_users(self, requests: Sequence[RetrieveRequest], lookup: EmbeddingLookup, now: Sequence[int]) -> UserState:
        """B requests, now (B,) seconds -> UserState on the device. The inputs are gathered on the CPU
        (per-request Python work) and moved in one transfer per tensor; the towers run on the device."""
        return self.model.users(self._inputs(requests, lookup, now).to(self.device))

    def _inputs(self, requests: Sequence[RetrieveRequest], lookup: EmbeddingLookup, now: Sequence[int]) -> UserInputs:
        """The user towers' inputs (CPU) for B requests: history and co-engagements looked up in the index."""
        B, S, L = len(requests), self.dim, self.model.dims.history
        hist = torch.zeros((B, L, S))
        hist_event = torch.zeros((B, L), dtype=torch.int64)
        hist_age = torch.zeros((B, L))
        hist_mask = torch.zeros((B, L), dtype=torch.bool)
        co = torch.zeros((B, CO_ITEMS, S))
        co_mask = torch.zeros((B, CO_ITEMS), dtype=torch.bool)
        segments = torch.full((B, SEGMENTS), -1, dtype=torch.int64)
        for b, r in enumerate(requests):
            events = engagements_as_of(r, now[b])
            engaged = {h.ad_id for h in events}
            if events:  # the last L engagements with ads the index holds, oldest first, as in training (whose
                # histories hold engagements alone: impressions and hides would push them out, and read as ones)
                vectors, found = lookup([h.ad_id for h in events])
                keep = found.nonzero().flatten()[-L:].tolist()
                events, n = [events[i] for i in keep], len(keep)
                hist[b, :n], hist_mask[b, :n] = vectors[keep], True
                hist_event[b, :n] = torch.tensor([EVENTS.index(h.event) for h in events], dtype=torch.int64)
                hist_age[b, :n] = torch.tensor([max(0, now[b] - h.ts) / 3600 for h in events])  # 0 within the skew
            co_ids = [c.ad_id for c in r.user.co_engagement if c.ad_id not in engaged]  # as in training, which
            if co_ids:  # reads no co-engagement with an ad the user engaged with (serving did until 2026-12-07); the
                vectors, found = lookup(co_ids)  # last CO_ITEMS the index holds (not the last given, then those held)
                keep = found.nonzero().flatten()[-CO_ITEMS:]
                co[b, : len(keep)], co_mask[b, : len(keep)] = vectors[keep], True
            held = segment_ids(r.user.cohorts, r.user.attributes, self.schema)
            segments[b, : len(held)] = torch.tensor(held, dtype=torch.int64)
        context = torch.tensor([self._context(r, t) for r, t in zip(requests, now)], dtype=torch.int64)
        return UserInputs(hist, hist_event, hist_age * hist_mask, hist_mask, segments, segments >= 0, co, co_mask,
                          context.reshape(B, 3))

    @torch.no_grad()
    def score(self, users: UserState, ads: torch.Tensor) -> torch.Tensor:
        """users on the device (B requests), ads (n, S) on the device -> (B, n) float32 scores."""
        return self.model.score(users, ads)

    @torch.no_grad()
    def kernel_head(self, users: UserState) -> KernelHead:
        return self.model.head.kernel_head(users)


def load_scorer(path: str | Path | None, schema: Schema, device: str | torch.device = "cpu"):
    """The trained checkpoint at `path` on `device`, or, without one, the untrained hashed two-tower."""
    from andromeda_core.models.two_tower import HashedTwoTower

    return ModelScorer.load(path, schema, device) if path else HashedTwoTower(device=device, schema=schema)
