"""Error bars for the offline quality report: per-user metrics and percentile bootstrap over users."""
from __future__ import annotations

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


def significant(low: float, high: float) -> bool:
    """A difference is significant iff its interval excludes 0."""
    return low > 0 or high < 0


def format_ci(mean: float, low: float, high: float) -> str:
    """'0.0426 [0.0279, 0.0590]'."""
    return f"{mean:.4f} [{low:.4f}, {high:.4f}]"
