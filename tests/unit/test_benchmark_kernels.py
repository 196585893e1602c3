"""benchmarks.kernels: the vector bytes it counts are those of the rows the pass reads, once per batch, in the units
memory moves them in; FAISS is timed at its fastest, in turn with ours."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import kernels
from benchmarks.common import timed_in_turn
from benchmarks.kernels import Requests, Table, bytes_per_ad, rows_read, vector_bytes
from kernels.reference.fused import ALWAYS


def test_rows_read_is_the_share_of_ads_some_request_of_the_batch_may_be_served():
    """Ads 0-1 run in [0, 10), ad 2 in [10, 20), ad 3 is paused: a request at 5 is eligible for two ads, one at 15
    for one; both together read three rows of four (the mean eligible share would say 3 of 8)."""
    status = torch.tensor([7, 7, 7, 0], dtype=torch.int8)
    start, end = torch.tensor([0, 0, 10, 0]), torch.tensor([10, 10, 20, 20])
    table = Table(status, start, end, torch.full((4, 1), ALWAYS, dtype=torch.int32), torch.zeros((4, 3)))
    requests = Requests(torch.tensor([5, 15]), torch.zeros((2, 1), dtype=torch.int32))
    assert rows_read(table, requests, 1) == 0.5
    assert rows_read(table, requests, 2) == 0.75


def test_row_bytes_are_the_cache_lines_or_sectors_a_row_occupies():
    """fp16 rows of 128 dims (256 B): dims 0-79 span bytes 0-159 and the bias 224-225: 4 lines of 64 B on the CPU,
    6 sectors of 32 B on a GPU; int8 rows (128 B): bytes 0-79 and 112, 2 lines or 4 sectors, and a unit of scales."""
    assert (vector_bytes("fp16", "cpu"), vector_bytes("fp16", "cuda")) == (256, 192)
    assert (vector_bytes("int8", "cpu"), vector_bytes("int8", "cuda")) == (128 + 64, 128 + 32)
    refs = 6
    assert bytes_per_ad("int8", "cpu", refs, 0.25, False, 16) == 17 + 24 + 0.25 * 192
    assert bytes_per_ad("fp16", "cuda", refs, 0.25, False, 16) == 17 + 24 + 192  # every row, matched or not
    assert bytes_per_ad("fp16", "cuda", refs, 0.25, True, 16) == (17 + 24 + 192) * (1 + 1 / 16)  # and the sample again
    assert bytes_per_ad("fp16", "cuda", refs, 0.25, False, 1) == 17 + 24 + 0.25 * 192  # one request: matched rows
    assert bytes_per_ad("fp16", "cuda", refs, 0.25, False, 2) == 17 + 24 + 192  # past MATCHED_ROWS_MAX_B (1)


def test_faiss_is_timed_at_its_fastest_setting_and_left_as_found(monkeypatch):
    faiss = pytest.importorskip("faiss")
    default = faiss.cvar.distance_compute_blas_threshold
    cost = {(1, 20): 3.0, (1, default): 2.0, (2, 20): 5.0, (2, default): 4.0}
    monkeypatch.setattr(kernels, "median_seconds", lambda fn, repeats: cost[(faiss.omp_get_max_threads(),
                                                                              faiss.cvar.distance_compute_blas_threshold)])
    assert kernels.faiss_best(lambda queries: None, None, 2, 3) == (2.0, (1, default))
    assert kernels.describe((1, default)) == f"1 thread, BLAS from {default:,} queries"
    assert faiss.omp_get_max_threads() == 2 and faiss.cvar.distance_compute_blas_threshold == default


def test_calls_in_turn_alternate_their_order_after_one_call_each():
    calls = []
    times = timed_in_turn({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and [len(t) for t in times.values()] == [3, 3]


def test_faiss_against_ours_is_the_median_of_the_rounds_ratios():
    pytest.importorskip("faiss")
    args = SimpleNamespace(rounds=5, threads=2, repeats=1)
    ours, faiss_time, ratio = kernels.versus_flat(lambda: time.sleep(0.004), lambda queries: time.sleep(0.012), None,
                                                  (0.0, (1, 20)), "cpu", args)
    assert ours < faiss_time and 2 < ratio < 4


def test_ours_runs_at_its_threads_whatever_thread_count_faiss_is_timed_at():
    """FAISS at 1 thread sets the OpenMP runtime that torch (and our pass, which asks torch) shares."""
    pytest.importorskip("faiss")
    seen = []
    kernels.versus_flat(lambda: seen.append(torch.get_num_threads()), lambda queries: None, None, (0.0, (1, 20)), "cpu",
                        SimpleNamespace(rounds=3, threads=2, repeats=1))
    assert seen == [2] * 4 and torch.get_num_threads() == 2
