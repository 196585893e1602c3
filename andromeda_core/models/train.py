"""Training with sampled softmax: each row's positive against every row's positive and shared
uniformly sampled negatives (none for the dense head); accidental hits are masked.

Rows are engagements (the next item a user engaged with) and, with a teacher, distillation rows:
a user state and one item drawn uniformly from the ranker's top-k for it, weighted by `distill`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from andromeda_core.models.distill import Teacher
from andromeda_core.models.recdata import RecData
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.towers import Dims


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1600
    batch: int = 256
    negatives: int = 512  # shared uniformly sampled negatives per step
    lr: float = 2e-3
    seed: int = 0
    distill: float = 1.0  # weight of the distillation rows (used only with a teacher)
    teacher_rows: int = 256  # distillation rows per step (used only with a teacher)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")


def default_config(kind: str, seed: int = 0) -> TrainConfig:
    """Sizes that train on 2 CPU cores in minutes; the pairwise heads score B x B pairs per step."""
    if kind == "ranker":  # the quality ceiling: uniform negatives teach it to rank the full corpus
        return TrainConfig(steps=1000, batch=96, negatives=256, lr=2e-3, seed=seed)
    if kind == "dense":
        return TrainConfig(steps=1600, batch=96, negatives=0, lr=1e-3, seed=seed, teacher_rows=96)
    return TrainConfig(seed=seed)


WARMUP = 0.1  # share of the steps over which the one-cycle schedule warms up


def lr_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """One-cycle (warm up over the first 10% of the steps, then cosine decay) when that warm-up spans more
    than one step. A run of <= 10 steps keeps cfg.lr: there OneCycleLR's warm-up phase ends at or before
    step 0, so it divides by zero (10 steps) or starts part-way down its decay (1 step: lr / 250,000)."""
    if cfg.steps * WARMUP > 1:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=WARMUP)
    return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0)


def _rows(data: RecData, examples: np.ndarray, teacher: Teacher | None, cfg: TrainConfig,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One step's rows: users (R,), positions (R,), positives (R,), known positives (R, K) padded
    with -1 (masked as accidental hits), loss weights (R,). Teacher rows follow the engagement rows."""
    batch = examples[rng.integers(0, len(examples), cfg.batch)]
    users, positions = batch[:, 0], batch[:, 1]
    positives = np.array([data.users.items[u][p] for u, p in batch])
    known, weights = positives[:, None], np.ones(cfg.batch, np.float32)
    if teacher is None:
        return users, positions, positives, known, weights
    asked = rng.integers(0, len(teacher.users), cfg.teacher_rows)
    top = teacher.top[asked]
    drawn = top[np.arange(len(asked)), rng.integers(0, top.shape[1], len(asked))]
    known = np.full((cfg.batch + len(asked), top.shape[1]), -1)
    known[: cfg.batch, 0], known[cfg.batch:] = positives, top
    return (np.concatenate([users, teacher.users[asked]]), np.concatenate([positions, teacher.positions[asked]]),
            np.concatenate([positives, drawn]), known,
            np.concatenate([weights, np.full(len(asked), cfg.distill, np.float32)]))


def _accidental_hits(known: np.ndarray, candidates: torch.Tensor, n_items: int) -> torch.Tensor:
    """(R, C) bool: candidate c is one of row r's known positives (R, K); padding (-1) marks a spare column."""
    known_t = torch.from_numpy(known)
    marks = torch.zeros((len(known), n_items + 1), dtype=torch.bool)
    marks[torch.arange(len(known))[:, None], torch.where(known_t >= 0, known_t, n_items)] = True
    return marks[:, candidates]


def train(data: RecData, kind: str, cfg: TrainConfig, teacher: Teacher | None = None,
          progress: bool = True) -> RetrievalModel:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model = RetrievalModel(kind, Dims(categories=len(data.items.categories) + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-5)
    sched = lr_schedule(opt, cfg)
    examples = data.train_examples()
    text = torch.from_numpy(data.items.text).float()
    n_items = len(data.items.ids)
    model.train()
    label = f"train {kind} on {data.name}" + (" (distilled)" if teacher is not None else "")
    bar = tqdm(range(cfg.steps), desc=label, disable=not progress)
    for _ in bar:
        users, positions, positives, known, weights = _rows(data, examples, teacher, cfg, rng)
        candidates = np.concatenate([positives, rng.integers(0, n_items, cfg.negatives)])
        # Run the ad tower only on the items this step reads (histories, co-engagements, candidates).
        needed = np.unique(np.concatenate([candidates, *(data.users.items[u][:p] for u, p in zip(users, positions)),
                                           *(data.users.co_items[u] for u in users)]).astype(np.int64))
        stored = torch.zeros((n_items, model.dims.stored)).index_put((torch.from_numpy(needed),),
                                                                     model.item_vectors(data.items, needed))
        state = model.users(user_inputs(data, stored, users, positions))
        candidates = torch.from_numpy(candidates)
        logits = model.score(state, stored[candidates], text[candidates])
        rows = torch.arange(len(users))
        hit = _accidental_hits(known, candidates, n_items)
        hit[rows, rows] = False  # each row's own positive stays
        losses = F.cross_entropy(logits.masked_fill(hit, float("-inf")), rows, reduction="none")
        weights_t = torch.from_numpy(weights)
        loss = (losses * weights_t).sum() / weights_t.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return model.eval()
