"""RetrievalModel = ad tower + user expert towers + one interaction head; safetensors checkpoints.

The model knows the external ids of the ads it learned an identity for (`item_ids`, sorted); any
other ad is embedded from its content alone. It also holds a click prior per ad shown in training
(`click_ids`, sorted, and `click_logodds`: RecData.click_logodds), set after training and added,
times dims.click_weight, to the bias of the ad's stored vector; an ad it holds none for gets 0."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from andromeda_core.models import find_sorted
from andromeda_core.models.heads import HEADS
from andromeda_core.models.recdata import Items, RecData
from andromeda_core.models.segments import SEGMENTS
from andromeda_core.models.text import TEXT_DIM
from andromeda_core.models.towers import AdTower, Dims, UserInputs, UserState, UserTowers

MODEL_VERSION = "10"  # 3: learned ad ids, ad bias, sequence expert; 4: segments (cohorts + declared attributes);
# 5: the ranker reads pair features (head.cross and a wider first layer); 6: click prior in the bias, which
# the user towers and the ranker's deep part no longer read; 7: the segment expert reads the text of described values;
# 8: the ranker's interest pair feature (features.NAMES); 9: the ranker's deep part scaled into the funnel
# (dims.deep_scale), so a ranker trained before, held to nothing, is trained again (and with it every checkpoint);
# 10: the ad tower adds the segment embeddings of the described values its text mentions (segments.mentions)
CO_ITEMS = 8
UNLOADABLE = (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError)  # what RetrievalModel.load
# raises for a checkpoint this code cannot use: missing or corrupt, of another model version, lacking a tensor or its
# metadata (TypeError), of tensors its dims do not fit (RuntimeError)


def served_name(model: RetrievalModel, categories: Sequence[str]) -> str:
    """The name a served model stamps on the ads it embeds (stream entries and snapshots carry it; a replica
    applies only its own model's): kind, model version and the first 12 hex digits of a SHA-256 over its sizes
    (dims, with the click prior's weight), tensors (names, dtypes, shapes, bytes) and category vocabulary, so two
    trainings of one kind differ."""
    digest = hashlib.sha256(json.dumps([asdict(model.dims), list(categories)], sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
                      .view(torch.uint8).numpy().tobytes())  # any dtype (numpy has no bfloat16)
    return f"{model.kind}-v{MODEL_VERSION}-{digest.hexdigest()[:12]}"


class RetrievalModel(nn.Module):
    def __init__(self, kind: str, dims: Dims, item_ids: np.ndarray | torch.Tensor = (),
                 click_ids: np.ndarray | torch.Tensor = (), click_logodds: np.ndarray | torch.Tensor = (),
                 described: tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor] | None = None):
        """described: (hashes (V,), texts (V, 384)) of the described values the segment expert reads
        (segments.described_table); None: it reads none."""
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"model must be one of {sorted(HEADS)}, got {kind!r}")
        self.kind, self.dims = kind, dims
        self.register_buffer("item_ids", torch.as_tensor(np.sort(np.asarray(item_ids, np.int64))))
        self.register_buffer("click_ids", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("click_logodds", torch.zeros(0))
        self.set_click_prior(click_ids, click_logodds)
        self.ad_tower = AdTower(dims, len(self.item_ids))
        self.user_towers = UserTowers(dims, 0 if described is None else len(described[0]))
        if described is not None:
            hashes, text = (torch.as_tensor(x).cpu() for x in described)
            if text.shape != (len(hashes), TEXT_DIM):
                raise ValueError(f"{len(hashes)} described hashes but texts of shape {tuple(text.shape)}")
            order = torch.argsort(hashes.long())
            if len(hashes) and not (hashes[order].diff() > 0).all():
                raise ValueError("described hashes must be distinct")
            self.user_towers.described_hashes.copy_(hashes[order].long())
            self.user_towers.described_text.copy_(text[order].half())
        self.head = HEADS[kind](dims)
        self.eval()  # dropout only where train() asks for it

    @property
    def described(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hashes (V,), texts (V, 384)) of the described values its segment expert reads."""
        return self.user_towers.described_hashes, self.user_towers.described_text

    def id_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) external ad ids -> (n,) rows of their learned identity, -1 for ads without one."""
        rows, found = find_sorted(self.item_ids, ids)
        return torch.where(found, rows, -1)

    @torch.no_grad()
    def set_click_prior(self, ids: np.ndarray | torch.Tensor, logodds: np.ndarray | torch.Tensor) -> None:
        """Holds the click log-odds (n,) of the ads with external ids (n,) (none: every ad gets 0)."""
        ids, logodds = np.asarray(ids, np.int64).reshape(-1), np.asarray(logodds, np.float32).reshape(-1)
        if len(ids) != len(logodds):
            raise ValueError(f"{len(ids)} ids but {len(logodds)} click log-odds")
        order = np.argsort(ids, kind="stable")
        self.click_ids = torch.as_tensor(ids[order], device=self.click_ids.device)
        self.click_logodds = torch.as_tensor(logodds[order], device=self.click_logodds.device)

    @contextlib.contextmanager
    def without_click_prior(self) -> Iterator["RetrievalModel"]:
        """The model with no click prior inside; the one it held is restored after."""
        held = self.click_ids, self.click_logodds
        self.set_click_prior((), ())
        try:
            yield self
        finally:
            self.click_ids, self.click_logodds = held

    def click_prior(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) external ad ids -> (n,) float32 click log-odds held for them, 0 for the others."""
        rows, found = find_sorted(self.click_ids, ids)
        return torch.where(found, self.click_logodds[rows] if len(self.click_ids) else 0.0, 0.0)

    def embed_ads(self, text: torch.Tensor, category: torch.Tensor, advertiser: torch.Tensor, bid: torch.Tensor,
                  ids: torch.Tensor, mentions: torch.Tensor, known: torch.Tensor | None = None) -> torch.Tensor:
        """(n, S) stored vectors: the ad tower's (text (n, 384), category, advertiser, bid, external ids (n,),
        mentions (n, m) int64 hashes of the described values the text mentions, -1 padding: segments.mentions; the
        first dims.mentions are read, of those the values its segment expert holds texts for, `described`),
        its bias raised by dims.click_weight x the ad's click prior. known (n,) bool, when given: False embeds
        the ad as one created after training (no learned identity, no prior)."""
        id_rows, prior = self.id_rows(ids), self.click_prior(ids)
        if known is not None:
            id_rows, prior = torch.where(known, id_rows, -1), torch.where(known, prior, 0.0)
        # The user towers' own segment table (one embedding per value, both sides), for the values it trained on: a
        # value that a serving schema adds would read an untrained row.
        mentions = mentions[:, : self.dims.mentions]
        mentioned = self.user_towers.segment_mean(mentions, find_sorted(self.user_towers.described_hashes, mentions)[1])
        stored = self.ad_tower(text, category, advertiser, bid, id_rows, mentioned)
        return torch.cat([stored[:, :-1], stored[:, -1:] + self.dims.click_weight * prior[:, None]], 1)

    def item_vectors(self, items: Items, rows: np.ndarray | None = None, known: torch.Tensor | None = None) -> torch.Tensor:
        """(n, S) stored vectors of the items at `rows` (every item when None); known (n,) bool, when
        given, keeps the learned identity and click prior only where True (False: as an ad created after training)."""
        rows = np.arange(len(items.ids)) if rows is None else rows
        return self.embed_ads(torch.from_numpy(items.text[rows]), torch.from_numpy(items.category[rows]),
                              torch.from_numpy(items.advertiser[rows]), torch.from_numpy(items.bid[rows]),
                              torch.from_numpy(items.ids[rows]), torch.from_numpy(items.mentions[rows]), known)

    def users(self, inputs: UserInputs) -> UserState:
        return self.user_towers(inputs)

    @property
    def pair_features(self) -> bool:
        """Whether the head reads pair features (andromeda_core.models.features): the ranker's does."""
        return getattr(self.head, "pair_features", False)

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None,
              cross: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n) scores of n candidates (stored (n, S); text (n, 384) and pair features cross (B, n, F) for
        the ranker only: absent features read as 0, what an ad created after training has)."""
        return self.head.score(state, stored, text, cross)

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        config = {"model": self.kind, "model_version": MODEL_VERSION, "dims": asdict(self.dims), **(meta or {})}
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(path).with_name(f"{Path(path).name}.{os.getpid()}.partial")  # a reader sees the whole file or
        save_file(tensors, str(partial), metadata={"config": json.dumps(config, sort_keys=True)})  # the one before
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> tuple["RetrievalModel", dict]:
        with safe_open(str(path), framework="pt") as f:
            config = json.loads(f.metadata()["config"])
        if not isinstance(config, dict):
            raise ValueError(f"{path}: its config is not a JSON object")
        if config.get("model_version") != MODEL_VERSION:
            raise ValueError(f"{path}: model version {config.get('model_version')} is not {MODEL_VERSION}")
        tensors = load_file(str(path))
        damaged = next((name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()), None)
        if damaged is not None:  # it would embed every ad as NaN: each write refused, one by one, at serving
            raise ValueError(f"{path}: {damaged} holds NaN or infinite values; train it again")
        model = cls(config["model"], Dims(**config["dims"]), tensors["item_ids"], tensors["click_ids"],
                    tensors["click_logodds"],
                    (tensors["user_towers.described_hashes"], tensors["user_towers.described_text"]))
        model.load_state_dict(tensors)
        return model.eval(), config


def _pad(rows: list[np.ndarray], width: int, fill: int) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        r = np.asarray(r)[-width:]
        out[i, : len(r)] = r
    return out


def user_inputs(data: RecData, stored: torch.Tensor, users: np.ndarray, positions: np.ndarray,
                length: int = Dims.history, keep: int | None = None) -> UserInputs:
    """Inputs of users (B,) as of their engagement at positions (B,): history = the `length` (or `keep`,
    when smaller: a short-history user) most recent engagements before it."""
    u, length = data.users, min(length, keep or length)
    starts = [max(0, p - length) for p in positions]
    length = max(1, min(length, max((p - s for s, p in zip(starts, positions)), default=1)))  # padding is inert
    hist_rows = _pad([u.items[a][s:p] for a, s, p in zip(users, starts, positions)], length, -1)
    events = _pad([u.events[a][s:p] for a, s, p in zip(users, starts, positions)], length, 0)
    at = np.array([u.times[a][p] if p < len(u.times[a]) else u.now[a] for a, p in zip(users, positions)])
    times = _pad([u.times[a][s:p] for a, s, p in zip(users, starts, positions)], length, 0)
    mask = hist_rows >= 0
    co_rows = _pad([u.co_items[a] for a in users], CO_ITEMS, -1)
    segments = _pad([u.segments[a] for a in users], SEGMENTS, -1)
    return UserInputs(
        hist=stored[torch.from_numpy(np.maximum(hist_rows, 0))] * torch.from_numpy(mask)[..., None],
        hist_event=torch.from_numpy(events),
        hist_age=torch.from_numpy(((at[:, None] - times) / 3600.0).astype(np.float32) * mask),
        hist_mask=torch.from_numpy(mask),
        segments=torch.from_numpy(segments), segment_mask=torch.from_numpy(segments >= 0),
        co=stored[torch.from_numpy(np.maximum(co_rows, 0))] * torch.from_numpy(co_rows >= 0)[..., None],
        co_mask=torch.from_numpy(co_rows >= 0),
        context=torch.from_numpy(u.context[users]),
    )
