"""Experiment (not served): what a synthetic world lets a model learn about its true affinity, and a quality
fallback for the part the MoE cannot learn. Reads the cached world and a MoE checkpoint of `andromeda eval`;
prints the markdown tables of docs/experiments/quality-fallback.md.

    python docs/experiments/quality_fallback.py synthetic .cache/models/synthetic-moe-distill2.safetensors

The fallback: of the 1,000 candidates, the first rho x 1,000 are the MoE's own top (as served today, click prior
included), the rest the eligible ads of highest click prior (clicks per impression, smoothed) among the others.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from andromeda_core.models import evaluate
from andromeda_core.models.quality import engagement_distribution, load_data
from andromeda_core.models.retrieval import UNLOADABLE, RetrievalModel
from andromeda_core.synth import truth_scores

USERS, TOP, RHOS = 600, 1000, (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def model_scores(model: RetrievalModel, data, users: np.ndarray, vectors: torch.Tensor) -> torch.Tensor:
    """(U, N) the model's score of every item for users at their held-out position, history at -inf."""
    text = torch.from_numpy(data.items.text).float()
    out = []
    with torch.no_grad():
        for first in range(0, len(users), 50):
            us = users[first:first + 50]
            positions = np.array([data.split(u)[1] for u in us])
            state = model.users(evaluate.user_inputs(data, vectors, us, positions, model.dims.history, None))
            out.append(evaluate.without_history(evaluate.corpus_scores(model, state, vectors, text, None), data, us, positions))
    return torch.cat(out)


def probe_r2(features: np.ndarray, target: np.ndarray) -> float:
    """R^2 on a held-out 30% of rows of a ridge regression of target (n, d) on features (n, f)."""
    x = np.column_stack([features, np.ones(len(features))]).astype(np.float64)
    order = np.random.default_rng(0).permutation(len(x))
    fit, held = order[:int(0.7 * len(x))], order[int(0.7 * len(x)):]
    w = np.linalg.solve(x[fit].T @ x[fit] + 0.1 * np.eye(x.shape[1]), x[fit].T @ target[fit])
    residual = x[held] @ w - target[held]
    return 1 - (residual ** 2).sum() / ((target[held] - target[held].mean(0)) ** 2).sum()


def with_fallback(scores: torch.Tensor, prior: torch.Tensor, rho: float) -> torch.Tensor:
    """(U, TOP) item rows: each user's top rho x TOP by scores, then the rest by prior among the items not in it
    and not in the history (scores -inf)."""
    personal = scores.topk(round(rho * TOP), 1).indices
    by_prior = torch.argsort(prior, descending=True)
    rows = []
    for u in range(len(scores)):
        free = torch.isfinite(scores[u])
        free[personal[u]] = False
        rows.append(torch.cat([personal[u], by_prior[free[by_prior]][:TOP - personal.shape[1]]]))
    return torch.stack(rows)


def main(name: str, model: RetrievalModel) -> None:
    data = load_data(name)
    t, ads = data.truth, data.truth["item_ad"]
    users = data.eval_users()[:USERS]
    model.eval()
    served = model.item_vectors(data.items).detach()
    with model.without_click_prior():
        bare = model.item_vectors(data.items).detach()
    prior = (served[:, -1] - bare[:, -1]) / model.dims.click_weight  # the click log-odds, smoothed as chosen
    scores = model_scores(model, data, users, served)
    positions = np.array([data.split(u)[1] for u in users])
    truth = evaluate.without_history(torch.from_numpy(np.stack(
        [truth_scores(t["user_latent"][u], t["ad_latent"][ads], t["ad_quality"][ads]) for u in users])).float(),
        data, users, positions)
    true_top = truth.topk(100, 1).indices.numpy()
    p = torch.from_numpy(engagement_distribution(data, users)).float()

    shown = np.concatenate(data.users.shown)
    quality, topic = t["ad_quality"][ads], t["ad_topic"][ads]
    latent = t["ad_latent"][ads].astype(np.float64)
    centres = np.stack([latent[topic == k].mean(0) if (topic == k).any() else np.zeros(latent.shape[1])
                        for k in range(topic.max() + 1)])
    own = np.array([np.isin(topic[true_top[i]], t["user_topic"][u]).mean() for i, u in enumerate(users)])
    print(f"## {name}\n\n{len(ads):,} ads, {len(shown) / len(ads):.1f} impressions and "
          f"{np.concatenate(data.train_sequences()).size / len(ads):.1f} training engagements per ad; "
          f"corr(click prior, true quality) {np.corrcoef(prior.numpy(), quality)[0, 1]:.2f}; "
          f"the true top-100 is {own.mean():.0%} ads of the user's own topics. The ad's latent (truth = 4 max_k <u_k, a> "
          f"+ q) from its stored MoE vector (ridge, held-out ads): R^2 {probe_r2(served.numpy(), latent):.3f}, of its part "
          f"apart from its topic's centre {probe_r2(served.numpy(), latent - centres[topic]):.3f}; its quality: "
          f"R^2 {probe_r2(served.numpy(), quality[:, None]):.3f}.\n")
    print("| candidates | true top-100 in top-1000 | expected HR@10 | HR@200 | HR@1000 |\n|---|---|---|---|---|")
    for rho in RHOS:
        top = with_fallback(scores, prior, rho)
        recall = np.mean([np.isin(true_top[i], top[i].numpy()).mean() for i in range(len(users))])
        hits = [p.gather(1, top[:, :k]).sum(1).mean().item() for k in (10, 200, 1000)]
        mine = round(rho * TOP)
        label = "MoE top-1000 (as served)" if rho == 1 else f"MoE top-{mine} + {TOP - mine} by click prior"
        print(f"| {label} | {recall:.3f} | " + " | ".join(f"{h:.4f}" for h in hits) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("world", choices=("synthetic", "synthetic-b"), help="a synthetic world (it knows its truth)")
    parser.add_argument("checkpoint", type=Path, help="a MoE checkpoint `andromeda eval` kept for that world")
    args = parser.parse_args()
    try:
        loaded, _ = RetrievalModel.load(args.checkpoint)
    except UNLOADABLE as exc:
        parser.error(f"checkpoint: {args.checkpoint} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})")
    main(args.world, loaded)
