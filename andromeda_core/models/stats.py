"""Error bars for the offline quality report: per-user metrics and percentile bootstrap over users."""
from __future__ import annotations

import functools

import numpy as np



def bootstrap_ci(values: np.ndarray, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """values (U,) per user -> (mean, low, high): percentile interval of the mean over resampled users."""
    values = np.asarray(values, np.float64)
    picks = np.random.default_rng(seed).integers(0, len(values), (n_boot, len(values)))
    means = values[picks].mean(1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(values.mean()), float(low), float(high)


def paired_difference(a: np.ndarray, b: np.ndarray, n_boot: int = 2000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """a, b (U,) per user for the same users -> (mean of a - b, low, high); one resample of the users
    serves both, which is resampling the per-user differences."""
    return bootstrap_ci(np.asarray(a, np.float64) - np.asarray(b, np.float64), n_boot, seed, level)


PAIRED_RESAMPLES = 10_000  # for p-values: with 2,000 a bound near 0 moved across it with the bootstrap's seed


def paired_p_value(a: np.ndarray, b: np.ndarray, margin: float = 0.0, n_boot: int = PAIRED_RESAMPLES,
                   seed: int = 0) -> float:
    """a, b (U,) per user for the same users. margin 0: the two-sided bootstrap p-value of "a's mean equals b's"
    (twice the smaller share of resampled mean differences on either side of 0); margin > 0: the one-sided p-value of
    "a's mean is below b's by margin or more" (the share of resampled differences at or below -margin): small where a
    is not worse than b by the margin (non-inferiority)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    means = resample_counts(len(d), n_boot, seed) @ d.astype(np.float32) / len(d)
    if margin > 0:
        return float((means <= -margin).mean())
    return float(min(1.0, 2 * min((means <= 0).mean(), (means >= 0).mean())))


@functools.lru_cache(maxsize=4)
def resample_counts(users: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, users) float32: how often each user is drawn in each resample, drawn once per size and seed (every
    comparison of one report reuses them: a resample's mean of d is then one matrix-vector product)."""
    picks = np.random.default_rng(seed).integers(0, users, (n_boot, users))
    return np.stack([np.bincount(row, minlength=users) for row in picks]).astype(np.float32)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (each compared with 0.05 after): the family's chance of
    any false "significant" stays at most 0.05, where each test alone at 0.05 let about one in twenty through."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def format_ci(mean: float, low: float, high: float) -> str:
    """'0.0426 [0.0279, 0.0590]'."""
    return f"{mean:.4f} [{low:.4f}, {high:.4f}]"
