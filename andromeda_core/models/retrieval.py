"""RetrievalModel = ad tower + user expert towers + one interaction head; safetensors checkpoints.

The model knows the external ids of the ads it learned an identity for (`item_ids`, sorted); any
other ad is embedded from its content alone."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from andromeda_core.models.heads import HEADS
from andromeda_core.models.recdata import Items, RecData
from andromeda_core.models.segments import SEGMENTS
from andromeda_core.models.towers import AdTower, Dims, UserInputs, UserState, UserTowers

MODEL_VERSION = "6"  # 3: learned ad ids, ad bias, sequence expert; 4: segments (cohorts + declared attributes);
# 5: the ranker reads pair features (head.cross and a wider first layer); 6: ad bias reads logged click log-odds
CO_ITEMS = 8


def served_name(kind: str) -> str:
    """The name a served model of `kind` stamps on the ads it embeds (stream entries carry it)."""
    return f"{kind}-v{MODEL_VERSION}"


class RetrievalModel(nn.Module):
    def __init__(self, kind: str, dims: Dims, item_ids: np.ndarray | torch.Tensor = ()):
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"model must be one of {sorted(HEADS)}, got {kind!r}")
        self.kind, self.dims = kind, dims
        self.register_buffer("item_ids", torch.as_tensor(np.sort(np.asarray(item_ids, np.int64))))
        self.ad_tower = AdTower(dims, len(self.item_ids))
        self.user_towers = UserTowers(dims)
        self.head = HEADS[kind](dims)
        self.eval()  # dropout only where train() asks for it

    def id_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) external ad ids -> (n,) rows of their learned identity, -1 for ads without one."""
        ids = ids.to(self.item_ids.device)
        if not len(self.item_ids):
            return torch.full_like(ids, -1)
        rows = torch.searchsorted(self.item_ids, ids).clamp(max=len(self.item_ids) - 1)
        return torch.where(self.item_ids[rows] == ids, rows, -1)

    @torch.no_grad()
    def set_click_logodds(self, ids: np.ndarray, logodds: np.ndarray) -> None:
        """The click log-odds (AdTower.click_logodds) of the ads with external ids (n,) to logodds (n,);
        ads without a learned identity are left out, every other identity gets 0."""
        rows = self.id_rows(torch.as_tensor(np.asarray(ids, np.int64)))
        known = rows >= 0
        self.ad_tower.click_logodds.zero_()
        self.ad_tower.click_logodds[rows[known]] = torch.as_tensor(np.asarray(logodds, np.float32))[known]

    def item_vectors(self, items: Items, rows: np.ndarray | None = None, known: torch.Tensor | None = None) -> torch.Tensor:
        """(n, S) stored vectors of the items at `rows` (every item when None); known (n,) bool, when
        given, keeps the learned identity only where True (False: as an ad created after training)."""
        rows = np.arange(len(items.ids)) if rows is None else rows
        id_rows = self.id_rows(torch.from_numpy(items.ids[rows]))
        if known is not None:
            id_rows = torch.where(known, id_rows, -1)
        return self.ad_tower(torch.from_numpy(items.text[rows]), torch.from_numpy(items.category[rows]),
                             torch.from_numpy(items.advertiser[rows]), torch.from_numpy(items.bid[rows]), id_rows)

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
        save_file(tensors, str(path), metadata={"config": json.dumps(config, sort_keys=True)})

    @classmethod
    def load(cls, path: str | Path) -> tuple["RetrievalModel", dict]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            config = json.loads(f.metadata()["config"])
        if config.get("model_version") != MODEL_VERSION:
            raise ValueError(f"{path}: model version {config.get('model_version')} is not {MODEL_VERSION}")
        tensors = load_file(str(path))
        model = cls(config["model"], Dims(**config["dims"]), tensors["item_ids"])
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
