"""Quality vs scoring cost: one plot of a metric (with its bootstrap interval) against FLOPs per pair."""
from __future__ import annotations

from pathlib import Path


def plot_quality_vs_flops(points: list[dict], path: Path | str, title: str, metric: str = "HR@10") -> Path:
    """points: {name, flops (per pair), mean, low, high}; flops 0 (popularity, item-kNN) draws a dashed
    reference line over a band for its interval. Log-x scatter with error bars, a PNG at path; returns path."""
    import matplotlib  # the [bench] extra; imported here so that importing this module never needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    models = [p for p in points if p["flops"] > 0]
    for p in models:
        ax.errorbar(p["flops"], p["mean"], yerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]], fmt="o", capsize=3)
        ax.annotate(p["name"], (p["flops"], p["mean"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    for i, p in enumerate(p for p in points if p["flops"] == 0):
        line = ax.axhline(p["mean"], linestyle="--", linewidth=1, color=f"C{len(models) + i}")
        ax.axhspan(p["low"], p["high"], color=line.get_color(), alpha=0.08)
        ax.text(1.0, p["mean"], f" {p['name']}", transform=ax.get_yaxis_transform(), va="center", fontsize=8,
                color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per (user, ad) pair")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
