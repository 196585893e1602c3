"""The reference's top-n gating against a plain Python sort of each candidate's experts, with ties, masked
experts (-inf), NaN and +inf logits."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference.fused import top_n_gates

VALUES = [-1.0, 0.0, 0.5, 2.0, float("-inf"), float("inf"), float("nan")]  # few values: many ties
CASES = st.integers(1, 7).flatmap(lambda E: st.tuples(  # (columns: n candidates' logits over E experts, top_n)
    st.lists(st.lists(st.sampled_from(VALUES), min_size=E, max_size=E), min_size=1, max_size=9), st.integers(1, E)))


def python_gates(column: list[float], top_n: int) -> list[float]:
    """One candidate's logits over its experts -> gates, as the contract words them."""
    order = sorted(range(len(column)), key=lambda e: (0 if math.isnan(column[e]) else 1, -column[e]
                                                      if not math.isnan(column[e]) else 0, e))[:top_n]
    chosen = [column[e] for e in order]
    if any(math.isnan(x) or x == math.inf for x in chosen) or all(x == -math.inf for x in chosen):
        return [0.0] * len(column)
    top = max(chosen)
    weights = {e: math.exp(column[e] - top) for e in order}
    total = sum(weights.values())
    return [weights[e] / total if e in weights else 0.0 for e in range(len(column))]


@settings(max_examples=200, deadline=None)
@given(CASES)
def test_gates_match_a_python_sort(case):
    columns, top_n = case
    logits = torch.tensor(columns).T[None]  # (1, E, n)
    got = top_n_gates(logits, top_n)[0].T.tolist()
    for column, gates in zip(columns, got):
        assert gates == pytest.approx(python_gates(column, top_n), abs=1e-6), column


@settings(max_examples=200, deadline=None)
@given(CASES)
def test_gates_equal_a_stable_sorts_to_the_bit(case):
    """The same gates as choosing by a stable descending argsort along E (what the kernels were written against)."""
    columns, top_n = case
    logits = torch.tensor(columns).T[None]  # (1, E, n)
    top = torch.argsort(logits, dim=1, descending=True, stable=True)[:, :top_n]
    chosen = torch.full_like(logits, float("-inf")).scatter(1, top, logits.gather(1, top))
    assert torch.equal(top_n_gates(logits, top_n), torch.nan_to_num(torch.softmax(chosen, dim=1)))


def test_equal_logits_go_to_the_lower_expert():
    logits = torch.tensor([[[1.0], [3.0], [3.0], [3.0]]])  # experts 1, 2 and 3 tie
    assert top_n_gates(logits, 2)[0, :, 0].tolist() == [0.0, 0.5, 0.5, 0.0]
