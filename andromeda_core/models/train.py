"""Training with a logQ-corrected sampled softmax over mixed negatives.

Each row (an engagement: a user's state before it and the item engaged) scores its positive against
every row's positive (in-batch negatives, drawn as often as items are engaged) and shared uniformly
sampled negatives; accidental hits are masked. Every candidate's logit is corrected by the log of its
expected count in the candidate set (logQ), so popular items are not pushed down for being sampled
often. With a teacher, distillation rows follow: a user state and one item drawn uniformly from the
ranker's top-k for it, weighted by `distill`. A MoE may also learn each expert's own sampled softmax (the
expert alone against the same candidates, weighted by `expert_loss`), so every expert ranks by itself and
the gates mix experts that all retrieve. Only ads with at least `min_id_engagements` training engagements get a
learned identity (fewer do not pin one down), started from the items' co-engagement (identity.py), and their ids are dropped with probability `id_dropout` so the
content tower learns to stand in for them. Training stops early on the validation split (the
engagement before each user's test one, never a training target) and keeps the best weights. A ranker
warm-started from a MoE's frozen towers first takes the wide weights of its pair features from a grid
scored on that split (choose_pair_weights); they stay fixed while its deep part trains, and the deep part trained is
then scaled by the best-scoring of DEEP_SCALES whose top-100 keeps TrainConfig.funnel inside the MoE's top-1000 on
that split (scale_deep_part). Any other model
may go on from one of its own kind (the distilled MoE goes on from the undistilled one), and a MoE from a
SASRec-style two-tower (STARTS_FROM: the same weights, its ad tower and sequence expert trained); the
caller compares the result with where it started (quality.train_all chooses the MoE's distillation weight, 0
included, on validation).
Training and validation run without the click prior (RetrievalModel.click_prior); after them the model
takes the data's prior, its smoothing and weight chosen on the validation split (choose_click_prior), or at a
weight the caller sets (TrainConfig.click_weights).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from andromeda_core.models.distill import Teacher
from andromeda_core.models.evaluate import (TOP, Ranking, corpus_scores, mean_metric, rank_items, rank_of_targets,
                                            recall_within, without_history)
from andromeda_core.models.features import PairFeatures
from andromeda_core.models.heads import expert_similarities
from andromeda_core.models.identity import co_engagement_start
from andromeda_core.models.recdata import RecData
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.segments import described_table
from andromeda_core.models.towers import Dims, UserState
from andromeda_core.schema import load_schema


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # at most; early stopping may end sooner
    batch: int = 256
    negatives: int = 512  # shared uniformly sampled negatives per step
    lr: float = 5e-3  # peak of the one-cycle schedule; 2e-3 left the MoE short of trained in 1,000 steps (validation
    # on MovieLens 0.2166 -> 0.2282; expected HR@10 on synthetic-b 0.0208 -> 0.0260), 1e-2 overshoots (0.2209, 0.0143)
    weight_decay: float = 0.1  # AdamW's decoupled weight decay; 1e-5 before (MoE validation on the default synthetic
    # world 0.1091 -> 0.1174 and expected HR@10 0.0395 -> 0.0431 at 0.1; MovieLens within noise; 1e-2: no effect)
    seed: int = 0
    distill: float = 0.0  # weight of the distillation rows (used only with a teacher)
    teacher_rows: int = 128  # distillation rows per step (used only with a teacher)
    logq: bool = True  # correct every candidate's logit by log of its expected count in the candidate set
    balanced: bool = False  # sample users uniformly (then one of their engagements), not engagements
    id_dropout: float = 0.1  # share of ads embedded from content alone in each step
    context_dropout: float = 0.05  # share of training examples whose surface and placement read as unknown, as a
    # request that names neither (or a value the schema lacks) reads them at serving: untrained, those embedding rows
    # kept their random start and scaled every expert of such a request by noise
    min_id_engagements: int = 10  # training engagements an ad needs for a learned identity; rarer ads are content
    # alone (on the synthetic world, where an ad averages 2 engagements, ids from 1 up cut the two-tower's expected
    # HR@10 2.5x)
    id_start: float = 10.0  # RMS norm of the learned identities' start from co-engagement (co_engagement_start), so a
    # model starts from item-kNN's similarities instead of noise; 0: random (std 0.01). The MoE on MovieLens, 2,000
    # steps from scratch, validation at norms 1 / 3 / 10: 0.2536 / 0.2684 / 0.2694, against 0.2517 from noise
    expert_loss: float = 0.0  # MoE only: weight of each expert's own sampled softmax (expert_losses)
    validate_every: int = 250  # steps between validations (0: never; train all steps)
    validation_users: int = 1000
    patience: int = 2  # validations without improvement before stopping
    pair_users: int = 2000  # warm-started ranker: users whose validation engagement chooses the pair-feature weights
    funnel: float = 0.95  # warm-started ranker: the least share of its top-100 that must lie inside the top-1000 of the
    # MoE it starts from on validation, for its wide weights and its deep part's scale (a ranker only ever sees what
    # the retriever returns)
    click_weights: tuple[float, ...] | None = None  # the click prior's weights validation chooses among (None:
    # CLICK_WEIGHTS); one weight sets it, its smoothing still chosen: the logged next click or the affinity, a
    # product's choice (docs/quality.md, "The click prior")
    prior_users: int = 1000  # users whose validation engagement chooses the click prior (while the ranker validated
    # its deep part on 200, on those it chose w = 0 for the synthetic world, where 1,000 chose w = 1 for its MoE)

    def __post_init__(self):
        for name in ("steps", "prior_users"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("funnel", "context_dropout"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a share between 0 and 1, got {getattr(self, name)}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be at least 0, got {self.weight_decay}")
        if not 0 <= self.id_start < float("inf"):
            raise ValueError(f"id_start must be finite and at least 0, got {self.id_start}")
        if self.click_weights is not None and not (self.click_weights and all(0 <= w < float("inf")
                                                                              for w in self.click_weights)):
            raise ValueError(f"click_weights must be finite and at least 0, got {self.click_weights}")


STARTS_FROM = {"moe": ("moe", "sasrec")}  # kinds (of the same weights: neither head has any) a kind may go on
# from besides its own; the MoE goes on from the SASRec-style two-tower's trained ad tower and sequence expert


def check_start(kind: str, init_kind: str) -> None:
    """Raises ValueError unless a `kind` model may go on from a model of init_kind (a ranker starts from any
    kind's towers, frozen)."""
    allowed = STARTS_FROM.get(kind, (kind,))
    if kind != "ranker" and init_kind not in allowed:
        raise ValueError(f"a {kind} goes on only from a {' or a '.join(allowed)}, not a {init_kind}: only a ranker "
                         f"starts from any kind's towers")


def other_start(kind: str, init: RetrievalModel | None) -> str:
    """The other kind a `kind` model goes on from when it starts from init ("" for none, its own or a ranker's
    frozen towers)."""
    return init.kind if init is not None and init.kind != kind and init.kind in STARTS_FROM.get(kind, ()) else ""


PASSES = 12  # a retrieval model trains for about this many passes over the training engagements, within STEPS: 2,000
# steps against 1,000 lifted the MoE's validation on MovieLens (2.6 passes in 1,000 steps) 0.2288 -> 0.2517 and on
# synthetic-b (6.2 passes) 0.0967 -> 0.1282, and lowered it on the default synthetic world (13.7 passes) 0.1175 -> 0.1069
STEPS = (1000, 2000)  # the most set by `andromeda eval`'s 45-minute target (it took 44 minutes on one 2-core box, 83
# on another: README, "Not met yet")


def training_steps(examples: int) -> int:
    """Steps of about PASSES passes over `examples` training engagements, in whole validations, within STEPS."""
    per_validation = TrainConfig.validate_every * TrainConfig.batch
    return min(max(round(PASSES * examples / per_validation) * TrainConfig.validate_every, STEPS[0]), STEPS[1])


def default_config(kind: str, seed: int = 0, distill: float = 0.0, start: str = "", going_on: bool = False,
                   examples: int | None = None) -> TrainConfig:
    """Sizes that train on 2 CPU cores in minutes; the pairwise heads score B x C pairs per step. start: the
    other kind it goes on from (other_start). A MoE going on from a sasrec also learns each expert's own
    softmax: its fresh experts then retrieve on their own instead of leaning on the trained sequence expert.
    going_on: the steps that go on from the undistilled MoE, as distillation's do, at weight distill (0: the same
    steps without a teacher, which tells what the teacher adds from what more steps add). examples: the training
    engagements, which set the steps of a model trained from its start (training_steps; None: 1,000)."""
    if kind == "ranker":  # warm-started from the MoE's towers: only its head learns
        return TrainConfig(steps=300, batch=128, negatives=512, lr=1e-3, seed=seed, validate_every=100,
                           patience=1)  # ranking the corpus with the ranker is slow (about 44 s of one core per
        # validation on 1,000 users of the default world), so its deep part goes on only while each validation gains.
        # On 200 users validation kept it silent on both synthetic worlds; on 1,000 (2026-12-07, one run each) the
        # default world kept it at scale 0.5, synthetic-b whole, MovieLens (all 610) whole
    if distill or going_on:  # goes on from the undistilled model, so it stays near the retriever the ranker was built on
        return TrainConfig(steps=300, lr=5e-4, seed=seed, distill=distill)
    steps = training_steps(examples) if examples is not None else TrainConfig.steps
    return TrainConfig(steps=steps, seed=seed, expert_loss=1.0 if start == "sasrec" else 0.0)


PAIR_WEIGHTS = ((0.0, 10.0, 20.0), (0.0, 10.0, 20.0, 40.0), (0.0, 10.0, 20.0), (0.0, 0.5, -0.5), (0.0, 4.0, 8.0, 16.0))
# per pair feature (features.NAMES: knn1, knn5, knn50, pop, interest), 432 combinations; ties go to the earlier
# combination, the smaller weights


def _pair_weight_batches(model: RetrievalModel, data: RecData, users: np.ndarray, stored: torch.Tensor,
                         pair: PairFeatures, batch: int) -> Iterator[tuple[slice, np.ndarray, torch.Tensor, torch.Tensor]]:
    """Per batch of users at their validation engagements: (its slice of users (U,), positions (B,), the warm-started
    ranker's scores with its deep part and wide weights silent, the MoE's (B, N), history at -inf, pair features
    (B, N, F)); stored (N, S): the item vectors."""
    for first in range(0, len(users), batch):
        rows = slice(first, first + batch)
        us = users[rows]
        positions = np.array([data.split(u)[0] for u in us])
        state = model.users(user_inputs(data, stored, us, positions, model.dims.history))
        base = without_history(model.head.wide.score(state, stored), data, us, positions)  # -inf stays -inf
        yield rows, positions, base, pair.dense(data, us, positions)


SHARES_CHECKED = 8  # combinations whose share kept choose_pair_weights measures in one more pass over the users


@torch.no_grad()
def choose_pair_weights(model: RetrievalModel, data: RecData, users: np.ndarray, pair: PairFeatures,
                        grid: tuple[tuple[float, ...], ...] = PAIR_WEIGHTS, funnel: float = TrainConfig.funnel,
                        batch: int = 64) -> dict[tuple, tuple[float, float | None]]:
    """Sets the wide weights of a warm-started ranker's pair features (its deep part still silent) to the
    combination of the grid with the best validation score (mean of HR@10, HR@50, HR@200 and NDCG@10 at
    the users' validation engagements, the split early stopping reads) among those that keep at least
    `funnel` of the ranker's top-100 inside the top-1000 of the MoE it starts from (a ranker only ever
    sees what the retriever returns; all zeros keep everything). Returns (score, share kept) per combination;
    the share is measured only for the best-scoring combinations down to the one chosen (None for the rest), in
    passes of SHARES_CHECKED: measuring every share (a top-100 per combination and user) took 44 of the 99 s.

    Chosen like a hyperparameter, not by gradient: the frozen towers were fit on every training
    engagement, so on training rows the MoE term is in-sample and the weights learned there undervalue
    the features (on MovieLens, with knn5, knn50 and pop only, gradient training settled at 4.4 on knn5
    where validation preferred 20). A feature that is 0 for every pair (PairFeatures.live) is tried at weight 0 only."""
    grid = tuple(weights if live else (0.0,) for weights, live in zip(grid, pair.live(), strict=True))
    combos = torch.tensor(list(itertools.product(*grid)), dtype=torch.float32)  # (K, F)
    ranks = np.zeros((len(combos), len(users)), np.int64)  # (K, U) made up front: a small array kept per combination
    # and batch between the (B, N) temporaries fragmented the heap (16 GB resident for 432 combinations over 2,000
    # users of the default synthetic world)
    stored = model.item_vectors(data.items)
    for rows, positions, base, cross in _pair_weight_batches(model, data, users, stored, pair, batch):
        for k, w in enumerate(combos):
            ranks[k, rows] = rank_of_targets(base + cross @ w, data, users[rows], positions)
    scores = [mean_metric(r) for r in ranks]
    order = sorted(range(len(combos)), key=lambda k: (-scores[k], k))  # best first; of equals, the earlier
    shares: dict[int, float] = {}
    for start in range(0, len(order), SHARES_CHECKED):
        checked = order[start:start + SHARES_CHECKED]
        kept = np.zeros((len(checked), len(users)))
        for rows, _, base, cross in _pair_weight_batches(model, data, users, stored, pair, batch):
            n = base.shape[1]
            inside = torch.zeros_like(base, dtype=torch.bool).scatter_(1, base.topk(min(TOP, n), dim=1).indices, True)
            for row, k in enumerate(checked):
                top = (base + cross @ combos[k]).topk(min(100, n), dim=1).indices
                kept[row, rows] = inside.gather(1, top).float().mean(1)
        shares.update({k: float(share.mean()) for k, share in zip(checked, kept)})
        allowed = [k for k in checked if shares[k] >= funnel]
        if allowed:
            break
    model.head.cross.copy_(combos[allowed[0]])
    return {tuple(w.tolist()): (scores[k], shares.get(k)) for k, w in enumerate(combos)}


DEEP_SCALES = (1.0, 0.5, 0.25, 0.0)  # scales of a warm-started ranker's trained deep part tried (scale_deep_part)


@torch.no_grad()
def scale_deep_part(model: RetrievalModel, data: RecData, users: np.ndarray, moe_top: np.ndarray, funnel: float,
                    known: dict[float, Ranking] | None = None,
                    pair: PairFeatures | None = None) -> dict[float, tuple[float, float]]:
    """Scales the trained deep part of a warm-started ranker (its output layer) by the scale of DEEP_SCALES with the
    best validation score at the users (U,) among those whose top-100 keeps at least `funnel` inside the top-1000 of
    the MoE it starts from (moe_top (U, TOP)); 0 (silent: the MoE and the wide weights chosen within the funnel on
    more users, choose_pair_weights) is always allowed. The scale is recorded in dims.deep_scale. Returns (score,
    share kept) per scale; of equal scores, the larger scale. Both models are judged without their click priors
    (chosen after), at the users the deep part's early stopping reads: a proxy for the report's target, which reads
    them with their priors, the ranker against the MoE kept (a student of it, perhaps). known: the validation rankings
    already made at some scales (training's of the deep part kept, at 1, and of its silent start, at 0); pair: the
    PairFeatures fit on data (fit per ranking when None).

    Trained for its validation score alone, the deep part reorders more than a ranker fed by the retriever may: on
    the default synthetic world (one run on 2 threads, 2026-12-06) it lifted the ranker's validation score (1,000
    users) 0.162 -> 0.178 while the share of its top-100 inside the MoE's top-1000 on the test engagements fell from
    97.5% to 90.0% (89.6% in the report of that day); scaled by this choice, 0.171 and 96.9%."""
    layer = model.head.mlp[-1]
    trained = layer.weight.clone(), layer.bias.clone()
    out = {}
    for scale in DEEP_SCALES:
        layer.weight.copy_(trained[0] * scale)
        layer.bias.copy_(trained[1] * scale)
        ranking = (known or {}).get(scale) or validation_ranking(model, data, users, pair)
        out[scale] = mean_metric(ranking.target_rank), recall_within(ranking.top[:, :100], moe_top)
    allowed = [scale for scale, (_, share) in out.items() if share >= funnel or scale == 0.0]
    best = max(allowed, key=lambda scale: out[scale][0])  # max keeps the first of equals
    layer.weight.copy_(trained[0] * best)
    layer.bias.copy_(trained[1] * best)
    model.dims = dataclasses.replace(model.dims, deep_scale=best)
    return out


def hold_click_prior(model: RetrievalModel, ids: np.ndarray, logodds: np.ndarray) -> None:
    """The model holds the click log-odds (N,) of the items with ids (N,), those that are not 0 (what an ad it
    holds none for gets)."""
    model.set_click_prior(ids[logodds != 0], logodds[logodds != 0])


CLICK_WEIGHTS = (0.0, 1.0, 2.0, 4.0, 8.0)  # weights of the click prior tried (choose_click_prior)
CLICK_SMOOTHINGS = (2.0, 5.0, 10.0, 20.0)  # smoothings of the click log-odds tried (RecData.click_logodds)


@torch.no_grad()
def choose_click_prior(model: RetrievalModel, data: RecData, pair: PairFeatures | None, users: np.ndarray,
                       smoothings: tuple[float, ...] = CLICK_SMOOTHINGS, weights: tuple[float, ...] = CLICK_WEIGHTS,
                       batch: int = 64) -> dict[tuple[float, float], float]:
    """Sets the model's click prior to the data's click log-odds at one smoothing (dims.click_smoothing) and its
    weight (dims.click_weight) to the pair of the grids with the best validation score: the mean of HR@10, HR@50,
    HR@200 and NDCG@10 with the full corpus ranked at the validation engagement of users (U,), the split early
    stopping reads. Returns the score per (smoothing, weight); {} when the data logs no impressions (MovieLens:
    every log-odds is 0, so no prior is held). Of equal scores, the smaller smoothing, then weight.

    Judged on the whole corpus, as retrieval ranks it. Judged by how well it ordered the clicked above the unclicked
    impressions a user was shown, the prior got weight 8, which lifted ads clicked once in a few impressions over
    the whole corpus and cut the MoE's expected HR@10 on the synthetic world 2.6x."""
    priors = {s: torch.from_numpy(data.click_logodds(s)) for s in smoothings}  # (N,) per item row
    if not any(p.any() for p in priors.values()):
        model.set_click_prior((), ())
        return {}
    with model.without_click_prior():
        stored = model.item_vectors(data.items)
    text = torch.from_numpy(data.items.text).float()
    ranks = {(s, w): np.zeros(len(users), np.int64) for s in smoothings for w in weights}  # filled in place (as
    # choose_pair_weights')
    for first in range(0, len(users), batch):
        us = users[first:first + batch]
        positions = np.array([data.split(u)[0] for u in us])
        state = model.users(user_inputs(data, stored, us, positions, model.dims.history))
        cross = pair.dense(data, us, positions) if pair is not None else None
        base = without_history(corpus_scores(model, state, stored, text, cross), data, us, positions)
        for smoothing, weight in ranks:
            ranks[smoothing, weight][first:first + len(us)] = rank_of_targets(base + weight * priors[smoothing], data,
                                                                              us, positions)
    out = {key: mean_metric(r) for key, r in ranks.items()}
    smoothing, weight = max(out, key=out.get)  # max keeps the first of equals
    hold_click_prior(model, data.items.ids, priors[smoothing].numpy())
    model.dims = dataclasses.replace(model.dims, click_smoothing=smoothing, click_weight=weight)
    return out


WARMUP = 0.1  # share of the steps over which the one-cycle schedule warms up


def lr_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """One-cycle (warm up over the first 10% of the steps, then cosine decay) when that warm-up spans more
    than one step. A run of <= 10 steps keeps cfg.lr: there OneCycleLR's warm-up phase ends at or before
    step 0, so it divides by zero (10 steps) or starts part-way down its decay (1 step: lr / 250,000)."""
    if cfg.steps * WARMUP > 1:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=WARMUP)
    return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0)


def example_weights(data: RecData, examples: np.ndarray, balanced: bool) -> np.ndarray:
    """(n,) probability of drawing each training example: uniform, or each user equally often."""
    if not balanced:
        return np.full(len(examples), 1 / len(examples))
    per_user = np.bincount(examples[:, 0], minlength=len(data.users.items))
    w = 1 / per_user[examples[:, 0]]
    return w / w.sum()


def item_probability(rows: np.ndarray, weights: np.ndarray, n_items: int) -> np.ndarray:
    """(N,) probability that one draw of a row (weights (R,)) has each item (rows (R,)) as its positive."""
    return np.bincount(rows, weights=weights, minlength=n_items)


def log_q(candidates: np.ndarray, engaged: np.ndarray, taught: np.ndarray | None, cfg: TrainConfig,
          n_items: int) -> torch.Tensor:
    """(C,) log of each candidate's expected count in one step's candidate set: batch draws from the
    engagement distribution engaged (N,), teacher_rows from the teacher's taught (N,), negatives uniform."""
    expected = cfg.batch * engaged[candidates] + cfg.negatives / n_items
    if taught is not None:
        expected = expected + cfg.teacher_rows * taught[candidates]
    return torch.from_numpy(np.log(expected)).float()


def _rows(data: RecData, examples: np.ndarray, draw: np.ndarray, teacher: Teacher | None, cfg: TrainConfig,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One step's rows: users (R,), positions (R,), positives (R,), known positives (R, K) padded
    with -1 (masked as accidental hits), loss weights (R,). Teacher rows follow the engagement rows."""
    batch = examples[rng.choice(len(examples), cfg.batch, p=draw)]
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


def expert_losses(dims: Dims, state: UserState, candidates: torch.Tensor, logq: torch.Tensor,
                  hit: torch.Tensor) -> torch.Tensor:
    """(R,) each row's sampled softmax loss of every usable expert alone, averaged over them: expert e's logits are
    <u_e, a> + b against the candidates (C, S), minus logq (C,), accidental hits (R, C) masked; row r's positive
    is candidate r. It keeps each expert a retriever on its own, so the gates mix experts that all rank."""
    sims = expert_similarities(dims, state, candidates) + dims.bias(candidates) - logq
    R, E, C = sims.shape
    per = F.cross_entropy(sims.masked_fill(hit[:, None], float("-inf")).reshape(R * E, C),
                          torch.arange(R).repeat_interleave(E), reduction="none").reshape(R, E)
    usable = state.mask.float()
    return (per * usable).sum(1) / usable.sum(1).clamp(min=1)


def validation_ranking(model: RetrievalModel, data: RecData, users: np.ndarray,
                       pair: PairFeatures | None = None) -> Ranking:
    """The users' (U,) rankings of the full corpus at their validation engagements (in eval mode; the model's modes
    are restored after; pair: the PairFeatures fit on data, as rank_items)."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    ranking = rank_items(model, data, users, split=0, progress=False, pair=pair)
    for m, training in modes.items():
        m.train(training)
    return ranking


def validation_score(model: RetrievalModel, data: RecData, users: np.ndarray) -> float:
    """Mean of HR@10, HR@50, HR@200 and NDCG@10 at the users' validation engagements (validation_ranking)."""
    return mean_metric(validation_ranking(model, data, users).target_rank)


def learn_mode(model: RetrievalModel, frozen: bool) -> None:
    """Train mode (dropout on), except in frozen towers, which run as they will at inference."""
    model.train()
    if frozen:
        model.ad_tower.eval()
        model.user_towers.eval()


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms inside, the caller's choice restored after. Without them, the CPU
    backward of indexing with repeated rows (stored[candidates], histories) adds into the gradient from
    several threads in no fixed order, so two processes trained different weights from the same seed."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def new_model(data: RecData, kind: str, cfg: TrainConfig, init: RetrievalModel | None = None) -> RetrievalModel:
    """An untrained `kind` model for data: a learned identity for each ad engaged at least cfg.min_id_engagements
    times in training, started from co-engagement (co_engagement_start) at RMS norm cfg.id_start unless a model to
    start from (init) gives its weights or cfg.id_start is 0."""
    id_rows = data.train_items(cfg.min_id_engagements)
    dims = Dims(categories=len(data.items.categories) + 1, mentions=data.items.mentions.shape[1])
    model = RetrievalModel(kind, dims, data.items.ids[id_rows],
                           described=init.described if init is not None else described_table(load_schema()))
    if init is None and cfg.id_start and len(id_rows):
        in_id_order = id_rows[np.argsort(data.items.ids[id_rows], kind="stable")]  # the model's identity rows
        with torch.no_grad():
            model.ad_tower.identity.weight[: len(id_rows), : model.dims.dim] = co_engagement_start(
                data, in_id_order, model.dims.dim, cfg.id_start)
    return model


def train(data: RecData, kind: str, cfg: TrainConfig, teacher: Teacher | None = None, init: RetrievalModel | None = None,
          progress: bool = True) -> RetrievalModel:
    """A `kind` model trained on data, bit for bit the same for a seed in any process on the same machine and
    thread count. init: a trained model to start from. Of the same kind, training goes on from all its
    weights (distillation starts from the undistilled MoE). A ranker starts from a MoE's towers, frozen: it
    then begins as good as the MoE on validation and keeps that if it can't do better."""
    with deterministic():
        return _train(data, kind, cfg, teacher, init, progress)


def _train(data: RecData, kind: str, cfg: TrainConfig, teacher: Teacher | None, init: RetrievalModel | None,
           progress: bool) -> RetrievalModel:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    context_rng = np.random.default_rng([cfg.seed, 1])  # its own stream: the draws of rng stay those they were
    examples = data.train_examples()
    n_items = len(data.items.ids)
    model = new_model(data, kind, cfg, init)
    val_users = data.eval_users()[: cfg.validation_users]
    best, best_state, since_best = -1.0, None, 0
    frozen = init is not None and kind == "ranker"
    if init is not None:  # the prior it holds, so its state loads as it is
        model.set_click_prior(init.click_ids.cpu(), init.click_logodds.cpu())
    if init is not None and not frozen:  # training goes on from all the weights of a model it may start from
        check_start(kind, init.kind)
        model.load_state_dict(init.state_dict())
    if frozen:  # the towers come trained and stay as they are: only the head learns
        missing, _ = model.load_state_dict({k: v for k, v in init.state_dict().items() if not k.startswith("head.")},
                                           strict=False)
        if any(not k.startswith("head.") for k in missing):
            raise ValueError(f"the model to start from lacks {[k for k in missing if not k.startswith('head.')][:3]}")
        model.ad_tower.requires_grad_(False)
        model.user_towers.requires_grad_(False)
    model.set_click_prior((), ())  # trained and validated without the click prior, added after (trained with
    # it, the softmax learns to cancel it)
    pair = PairFeatures.fit(data) if model.pair_features else None
    if frozen and pair is not None and cfg.validate_every:  # the deep part is silent: the ranker is MoE + wide
        choose_pair_weights(model, data, data.eval_users()[: cfg.pair_users], pair, funnel=cfg.funnel)  # weights
        model.head.cross.requires_grad_(False)
    funnel_top = None  # (U, TOP) the MoE's validation top-1000, which must keep cfg.funnel of the ranker's top-100
    start = best_ranking = None  # the validation rankings of the warm-started ranker's silent start and of the best
    if frozen and cfg.validate_every:
        start = best_ranking = validation_ranking(model, data, val_users, pair)
        best, best_state = mean_metric(start.target_rank), copy.deepcopy(model.state_dict())
        with init.without_click_prior():
            funnel_top = validation_ranking(init, data, val_users).top
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = lr_schedule(opt, cfg)
    draw = example_weights(data, examples, cfg.balanced)
    engaged = item_probability(np.array([data.users.items[u][p] for u, p in examples]), draw, n_items)
    taught = None if teacher is None else np.bincount(teacher.top.ravel(), minlength=n_items) / teacher.top.size
    text = torch.from_numpy(data.items.text).float()
    learn_mode(model, frozen)
    label = f"train {kind} on {data.name}" + (f" (distilled, {cfg.distill:g})" if teacher is not None else "")
    bar = tqdm(range(cfg.steps), desc=label, disable=not progress)
    for step in bar:
        users, positions, positives, known, weights = _rows(data, examples, draw, teacher, cfg, rng)
        candidates = np.concatenate([positives, rng.integers(0, n_items, cfg.negatives)])
        # Run the ad tower only on the items this step reads (histories, co-engagements, candidates).
        needed = np.unique(np.concatenate([candidates, *(data.users.items[u][max(0, p - model.dims.history):p]
                                                         for u, p in zip(users, positions)),
                                           *(data.users.co_items[u] for u in users)]).astype(np.int64))
        with_id = torch.from_numpy(rng.random(len(needed)) >= (0.0 if frozen else cfg.id_dropout))
        stored = torch.zeros((n_items, model.dims.stored)).index_put(
            (torch.from_numpy(needed),), model.item_vectors(data.items, needed, with_id))
        inputs = user_inputs(data, stored, users, positions, model.dims.history)
        unknown = torch.from_numpy(context_rng.random(len(users)) < cfg.context_dropout)[:, None]
        inputs.context[:, :2] = inputs.context[:, :2].masked_fill(unknown, 0)
        state = model.users(inputs)
        cross = pair.pairs(data, users, positions, candidates) if pair is not None else None
        logq = log_q(candidates, engaged, taught, cfg, n_items) if cfg.logq else torch.zeros(len(candidates))
        candidate_vectors = stored[candidates]
        logits = model.score(state, candidate_vectors, text[candidates], cross) - logq
        rows = torch.arange(len(users))
        hit = _accidental_hits(known, torch.from_numpy(candidates), n_items)
        hit[rows, rows] = False  # each row's own positive stays
        losses = F.cross_entropy(logits.masked_fill(hit, float("-inf")), rows, reduction="none")
        if cfg.expert_loss and kind == "moe":
            losses = losses + cfg.expert_loss * expert_losses(model.dims, state, candidate_vectors, logq, hit)
        weights_t = torch.from_numpy(weights)
        loss = (losses * weights_t).sum() / weights_t.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", **({"val": f"{best:.4f}"} if best_state is not None else {}),
                        refresh=False)  # the best validation score, once one has run
        if cfg.validate_every and ((step + 1) % cfg.validate_every == 0 or step + 1 == cfg.steps):
            ranking = validation_ranking(model, data, val_users, pair)
            score = mean_metric(ranking.target_rank)
            if score > best:
                best, best_state, best_ranking, since_best = score, copy.deepcopy(model.state_dict()), ranking, 0
            else:
                since_best += 1
                if since_best >= cfg.patience:
                    break
    if best_state is not None:
        model.load_state_dict(best_state)
    if funnel_top is not None and not model.head.silent:
        scale_deep_part(model, data, val_users, funnel_top, cfg.funnel, known={1.0: best_ranking, 0.0: start}, pair=pair)
    choose_click_prior(model.eval(), data, pair, data.eval_users()[: cfg.prior_users],
                       weights=cfg.click_weights or CLICK_WEIGHTS)
    return model
