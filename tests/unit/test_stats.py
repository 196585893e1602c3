"""Per-user metrics, bootstrap intervals over users, paired differences and the quality-vs-FLOPs plot."""
from __future__ import annotations

import numpy as np
import pytest

from andromeda_core.models.pareto import plot_quality_vs_flops
from andromeda_core.models.evaluate import per_user_metrics
from andromeda_core.models.stats import bootstrap_ci, format_ci, holm, paired_difference, paired_p_value


def test_per_user_metrics_follow_the_rank():
    m = per_user_metrics(np.array([0, 9, 10, 49, 199, 200]))
    assert m["HR@10"].tolist() == [1, 1, 0, 0, 0, 0]
    assert m["HR@50"].tolist() == [1, 1, 1, 1, 0, 0]
    assert m["HR@200"].tolist() == [1, 1, 1, 1, 1, 0]
    assert m["NDCG@10"] == pytest.approx([1.0, 1 / np.log2(11), 0, 0, 0, 0])


def test_bootstrap_interval_holds_the_mean_and_shrinks_with_more_users():
    rng = np.random.default_rng(1)
    widths = []
    for users in (200, 5000):
        hits = (rng.random(users) < 0.1).astype(float)
        mean, low, high = bootstrap_ci(hits)
        assert mean == hits.mean() and low < mean < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 3  # ~ 1 / sqrt(users): 5x
    assert bootstrap_ci(hits, seed=3) == bootstrap_ci(hits, seed=3)


def test_paired_difference_of_identical_arrays_is_exactly_zero():
    a = (np.random.default_rng(2).random(300) < 0.3).astype(float)
    assert paired_difference(a, a.copy()) == (0.0, 0.0, 0.0)


def test_paired_difference_sees_a_clear_gain_the_unpaired_intervals_overlap_on():
    rng = np.random.default_rng(3)
    b = rng.random(400)
    a = b + 0.02 + 0.01 * rng.standard_normal(400)  # the same users, a little better each
    mean, low, high = paired_difference(a, b)
    assert mean == pytest.approx(0.02, abs=0.002) and low > 0
    _, low_a, _ = bootstrap_ci(a)
    _, _, high_b = bootstrap_ci(b)
    assert low_a < high_b  # separately the two intervals overlap
    _, low, high = paired_difference(b[:200], b[200:])
    assert low < 0 < high  # two halves of one population


def test_format_ci():
    assert format_ci(0.04262, 0.02787, 0.059) == "0.0426 [0.0279, 0.0590]"


def test_pareto_plot_writes_a_png(tmp_path):
    points = [{"name": "moe", "flops": 20_000, "mean": 0.08, "low": 0.06, "high": 0.1},
              {"name": "two-tower", "flops": 256, "mean": 0.05, "low": 0.04, "high": 0.07},
              {"name": "popularity", "flops": 0, "mean": 0.04, "low": 0.03, "high": 0.05}]
    path = plot_quality_vs_flops(points, tmp_path / "pareto.png", "MovieLens test")
    assert path == tmp_path / "pareto.png" and path.stat().st_size > 5000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paired_p_values_and_holm():
    """A clear gain is significant, two halves of one population are not, identical arrays give 1; Holm multiplies the
    smallest p by the family's size and keeps the order; the non-inferiority p is small only where a cannot be worse
    by the margin."""
    rng = np.random.default_rng(5)
    b = rng.random(400)
    gain = b + 0.02 + 0.01 * rng.standard_normal(400)
    assert paired_p_value(gain, b) < 0.001 and paired_p_value(b[:200], b[200:]) > 0.05
    assert paired_p_value(b, b.copy()) == 1.0
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert paired_p_value(b, b + 0.001, margin=0.05) < 0.01  # a hair below, far within a 0.05 margin
    assert paired_p_value(b, b + 0.1, margin=0.05) > 0.99  # 0.1 below: worse than the margin
