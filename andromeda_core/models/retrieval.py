"""RetrievalModel = ad tower + user expert towers + one interaction head; safetensors checkpoints."""
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
from andromeda_core.models.towers import AdTower, Dims, UserInputs, UserState, UserTowers

MODEL_VERSION = "2"  # 2: the ranker gained its wide (MoE) term
HISTORY = 30  # most recent engagements a user tower reads
CO_ITEMS = 8
COHORTS = 8


class RetrievalModel(nn.Module):
    def __init__(self, kind: str, dims: Dims):
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"model must be one of {sorted(HEADS)}, got {kind!r}")
        self.kind, self.dims = kind, dims
        self.ad_tower = AdTower(dims)
        self.user_towers = UserTowers(dims)
        self.head = HEADS[kind](dims)

    def item_vectors(self, items: Items, rows: np.ndarray | None = None) -> torch.Tensor:
        """(n, S) stored vectors of the items at `rows` (every item when None)."""
        rows = np.arange(len(items.ids)) if rows is None else rows
        return self.ad_tower(torch.from_numpy(items.text[rows]), torch.from_numpy(items.category[rows]),
                             torch.from_numpy(items.advertiser[rows]), torch.from_numpy(items.bid[rows]))

    def users(self, inputs: UserInputs) -> UserState:
        return self.user_towers(inputs)

    def score(self, state: UserState, stored: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n) scores of n candidates (stored (n, S); text (n, 384) for the ranker only)."""
        return self.head.score(state, stored, text)

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
        model = cls(config["model"], Dims(**config["dims"]))
        model.load_state_dict(load_file(str(path)))
        return model.eval(), config


def _pad(rows: list[np.ndarray], width: int, fill: int) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        r = np.asarray(r)[-width:]
        out[i, : len(r)] = r
    return out


def user_inputs(data: RecData, stored: torch.Tensor, users: np.ndarray, positions: np.ndarray) -> UserInputs:
    """Inputs of users (B,) as of their engagement at positions (B,): history = everything before it."""
    u = data.users
    hist = [u.items[a][:p] for a, p in zip(users, positions)]
    hist_rows = _pad(hist, HISTORY, -1)
    events = _pad([u.events[a][:p] for a, p in zip(users, positions)], HISTORY, 0)
    at = np.array([u.times[a][p] if p < len(u.times[a]) else u.now[a] for a, p in zip(users, positions)])
    times = _pad([u.times[a][:p] for a, p in zip(users, positions)], HISTORY, 0)
    mask = hist_rows >= 0
    co_rows = _pad([u.co_items[a] for a in users], CO_ITEMS, -1)
    cohorts = _pad([u.cohorts[a] for a in users], COHORTS, -1)
    return UserInputs(
        hist=stored[torch.from_numpy(np.maximum(hist_rows, 0))] * torch.from_numpy(mask)[..., None],
        hist_event=torch.from_numpy(events),
        hist_age=torch.from_numpy(((at[:, None] - times) / 3600.0).astype(np.float32) * mask),
        hist_mask=torch.from_numpy(mask),
        cohorts=torch.from_numpy(cohorts), cohort_mask=torch.from_numpy(cohorts >= 0),
        co=stored[torch.from_numpy(np.maximum(co_rows, 0))] * torch.from_numpy(co_rows >= 0)[..., None],
        co_mask=torch.from_numpy(co_rows >= 0),
        context=torch.from_numpy(u.context[users]),
    )
