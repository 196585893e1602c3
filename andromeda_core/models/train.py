"""Training with sampled softmax: each example's positive against in-batch positives (and, for the
cheap heads, shared uniformly sampled negatives); accidental hits are masked."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from andromeda_core.models.recdata import RecData
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.towers import Dims


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 800
    batch: int = 256
    negatives: int = 512  # shared random negatives per step (0 for the pairwise heads)
    lr: float = 2e-3
    seed: int = 0


def default_config(kind: str, seed: int = 0) -> TrainConfig:
    """Sizes that train on 2 CPU cores in minutes; the pairwise heads score B x B pairs per step."""
    if kind == "ranker":  # the quality ceiling gets the longest training
        return TrainConfig(steps=2400, batch=96, negatives=0, lr=1e-3, seed=seed)
    if kind == "dense":
        return TrainConfig(steps=800, batch=96, negatives=0, lr=1e-3, seed=seed)
    return TrainConfig(seed=seed)


def train(data: RecData, kind: str, cfg: TrainConfig, progress: bool = True) -> RetrievalModel:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model = RetrievalModel(kind, Dims(categories=len(data.items.categories) + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    examples = data.train_examples()
    text = torch.from_numpy(data.items.text).float()
    n_items = len(data.items.ids)
    model.train()
    bar = tqdm(range(cfg.steps), desc=f"train {kind} on {data.name}", disable=not progress)
    for _ in bar:
        batch = examples[rng.integers(0, len(examples), cfg.batch)]
        users, positions = batch[:, 0], batch[:, 1]
        positives = torch.from_numpy(np.array([data.users.items[u][p] for u, p in batch]))
        candidates = torch.cat([positives, torch.from_numpy(rng.integers(0, n_items, cfg.negatives))])
        # Run the ad tower only on the items this step reads (histories, co-engagements, candidates).
        needed = np.unique(np.concatenate([candidates.numpy(), *(data.users.items[u][:p] for u, p in batch),
                                           *(data.users.co_items[u] for u in users)]).astype(np.int64))
        stored = torch.zeros((n_items, model.dims.stored)).index_put((torch.from_numpy(needed),),
                                                                     model.item_vectors(data.items, needed))
        state = model.users(user_inputs(data, stored, users, positions))
        logits = model.score(state, stored[candidates], text[candidates])
        hit = (candidates[None, :] == positives[:, None])
        hit[torch.arange(cfg.batch), torch.arange(cfg.batch)] = False  # own positive stays
        loss = F.cross_entropy(logits.masked_fill(hit, float("-inf")), torch.arange(cfg.batch))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return model.eval()
