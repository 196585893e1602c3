"""The fused kernels (Triton, and the compiled CPU path) against kernels.reference.fused, at odd sizes (not
multiples of BLOCK), plus hypothesis-drawn tables for the CPU path.

Without CUDA the Triton kernels run in Triton's interpreter (tests/conftest.py), so the tables stay small.
"""
from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from kernels import cpu, dispatch  # noqa: E402
from kernels.reference import fused as reference  # noqa: E402
from kernels.reference.fused import ALWAYS, SCALE_BLOCK  # noqa: E402
import triton  # noqa: E402

from kernels.triton import fused  # noqa: E402
from kernels.triton.match import clause_match_count  # noqa: E402

NOW = 1_000
W = 2  # truth words per request: clause ids < 64
ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA, Triton's interpreter (conftest.py)


@pytest.fixture(autouse=True)
def rows_round_alike_in_the_interpreter(monkeypatch):
    """Triton's interpreter computes tl.dot with numpy's float32 matmul, whose BLAS kernels round equal rows of a
    tile differently by their position (a GPU's MMA does not): under the interpreter, compute it in float64 and
    round once, so that equal rows score alike (ties) as they do on the device."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data
        return interpreter.TensorHandle(exact.astype(d.data.dtype), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def make_table(gen, n, C, S, dtype):
    """A random table of n slots: (status, start, end, refs, vectors, scales); mostly servable around NOW, each row
    0..C real refs (either sign) then ALWAYS padding."""
    status = torch.tensor([7, 7, 7, 7, 7, 7, 0, 1, 3, 5])[torch.randint(0, 10, (n,), generator=gen)].to(torch.int8)
    start = NOW + torch.randint(-20, 3, (n,), generator=gen)
    end = start + torch.randint(1, 40, (n,), generator=gen)
    refs = 2 * torch.randint(1, W * 32, (n, C), generator=gen) + torch.randint(0, 2, (n, C), generator=gen)
    used = torch.randint(0, C + 1, (n, 1), generator=gen)
    refs = torch.where(torch.arange(C) < used, refs, ALWAYS).to(torch.int32)
    if dtype == torch.int8:
        vectors = torch.randint(-127, 128, (n, S), generator=gen).to(torch.int8)
        scales = torch.rand((n, math.ceil(S / SCALE_BLOCK)), generator=gen) / 50 + 1e-3
    else:
        vectors, scales = torch.randn((n, S), generator=gen).to(dtype), None
    return status, start, end, refs, vectors, scales


def servable_table(n):
    """(status, start, end, refs) of n slots every request at NOW can be served."""
    return (torch.full((n,), 7, dtype=torch.int8), torch.zeros(n, dtype=torch.int64),
            torch.full((n,), 2 * NOW, dtype=torch.int64), torch.ones((n, 1), dtype=torch.int32))


def make_requests(gen, B, E, D, G):
    """B random requests: (now (B,), truth (B, W) with sign bits set, experts (B, E, D), keys (B, E, G), mask (B, E));
    expert 0 usable, some others masked, and with B > 1 the last request has none usable."""
    now = NOW + torch.randint(-3, 3, (B,), generator=gen)
    truth = torch.randint(-2**31, 2**31, (B, W), generator=gen, dtype=torch.int64).to(torch.int32)
    truth[:, 0] &= ~1  # clause 0 is never held: ALWAYS pads
    mask = torch.rand((B, E), generator=gen) < 0.6
    mask[:, 0] = True
    if B > 1:
        mask[-1] = False
    return now, truth, torch.randn((B, E, D), generator=gen), torch.randn((B, E, G), generator=gen), mask


def assert_same(got, want):
    """(slots, scores, eligible) of the kernel equal the reference's: slots and counts exactly, scores closely."""
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32 and got[2].dtype == torch.int64
    assert torch.equal(got[2], want[2])
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


def on_device(args):
    """The tensors among args moved to DEVICE, where the kernels run."""
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


def triton_scan(*args):
    return [t.cpu() for t in fused.fused_scan(*on_device(args))]


def triton_match(*args):
    """clause_match_count on DEVICE -> (mask, counts) on the CPU."""
    return [t.cpu() for t in clause_match_count(*on_device(args))]


def cpu_match(*args):
    ok = cpu.clause_match(*args)
    return ok, ok.sum(1)


KERNELS = {"triton": (triton_scan, triton_match), "cpu": (cpu.fused_scan, cpu_match)}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    """(fused_scan, match -> (mask, counts)) of one implementation, CPU tensors in and out."""
    return KERNELS[request.param]


def both(kernel, *args):
    """fused_scan's arguments -> (the kernel's result, the reference's), on the CPU."""
    return kernel[0](*args), reference.fused_scan(*args)


@pytest.mark.parametrize("n, B, C", [(1, 1, 1), (37, 3, 3), (301, 5, 4), (1000, 2, 6), (1000, 1, 6),  # B = 1: a bit per ref
                                     *[(203, 2, C) for C in (1, 2, 5, 7, 8, 9)]])  # every unrolled width, and 9: the loop
def test_match_equals_reference(kernel, n, B, C):
    gen = torch.Generator().manual_seed(n)
    status, start, end, refs, _, _ = make_table(gen, n, C, 1, torch.float32)
    now, truth, *_ = make_requests(gen, B, 1, 1, 0)
    got, counts = kernel[1](status, start, end, refs, truth, now)
    want = reference.clause_match(status, start, end, refs, truth, now)
    assert torch.equal(got, want)
    assert torch.equal(counts, want.sum(1))
    assert 0 < int(counts.sum()) < B * n or n < 100  # the draw exercises both outcomes at the larger sizes


def test_every_rule_and_slot_kind(kernel):
    truth = torch.tensor([[(1 << 3) | -2**31, 1]], dtype=torch.int32)  # clauses 3, 31 (the sign bit) and 32 held
    rows = [  # (refs, status, start, end, eligible)
        ([6, 1, 1], 7, 0, 2000, True),  # held clause
        ([8, 1, 1], 7, 0, 2000, False),  # clause not held
        ([7, 1, 1], 7, 0, 2000, False),  # negated held clause
        ([9, 1, 1], 7, 0, 2000, True),  # negated clause not held
        ([62, 1, 1], 7, 0, 2000, True),  # clause 31: bit 31 of a negative word
        ([63, 1, 1], 7, 0, 2000, False),
        ([64, 62, 6], 7, 0, 2000, True),  # every ref holds
        ([64, 62, 8], 7, 0, 2000, False),  # all refs must hold
        ([127, 61, 1], 7, 0, 2000, True),  # negated clauses 63 and 30 not held
        ([1, 1, 1], 7, NOW, NOW + 1, True),  # padding only; the window's both ends
        ([1, 1, 1], 7, 0, NOW, False),  # expired
        ([1, 1, 1], 7, NOW + 1, 2000, False),  # not started
        ([1, 1, 1], 5, 0, 2000, False),  # paused: not ACTIVE
        ([1, 1, 1], 3, 0, 2000, False),  # not SATISFIABLE
        ([1, 1, 1], 6, 0, 2000, False),  # not LIVE
        ([1, 1, 1], 0, 0, 2000, False),  # tombstoned
    ]
    refs = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    status = torch.tensor([r[1] for r in rows], dtype=torch.int8)
    start, end = torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows])
    expected = torch.tensor([[r[4] for r in rows]])
    now = torch.tensor([NOW])
    got, counts = kernel[1](status, start, end, refs, truth, now)
    assert torch.equal(got, expected) and torch.equal(reference.clause_match(status, start, end, refs, truth, now),
                                                      expected)
    assert counts.tolist() == [int(expected.sum())]
    vectors = torch.randn((len(rows), 8))
    head = (torch.randn((1, 1, 8)), torch.randn((1, 1, 0)), torch.ones((1, 1), dtype=torch.bool), -1, 1)
    got, want = both(kernel, status, start, end, refs, vectors, None, now, truth, *head, len(rows))
    assert_same(got, want)
    assert sorted(s for s in got[0][0].tolist() if s >= 0) == expected[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("n, B, dtype, E, D, G, top_n, bias, m", [
    (1, 1, torch.float32, 1, 64, 0, 1, False, 3),  # the dot product
    (37, 3, torch.float16, 1, 64, 0, 1, True, 10),  # fewer eligible than m
    (301, 5, torch.int8, 6, 64, 16, 2, False, 20),  # the mixture of logits
    (301, 2, torch.float32, 3, 16, 16, 5, True, 200),  # top_n >= E; m > BLOCK: blocks keep every key
    (1000, 3, torch.float16, 6, 32, 16, 2, True, 50),
    (1000, 1, torch.int8, 6, 64, 16, 2, True, 7),
])
def test_fused_scan_equals_reference(kernel, n, B, dtype, E, D, G, top_n, bias, m):
    gen = torch.Generator().manual_seed(n * 10 + B)
    S = D + G + 3  # not a multiple of SCALE_BLOCK
    status, start, end, refs, vectors, scales = make_table(gen, n, 4, S, dtype)
    now, truth, experts, keys, mask = make_requests(gen, B, E, D, G)
    got, want = both(kernel, status, start, end, refs, vectors, scales, now, truth, experts, keys, mask,
                     D + G + 1 if bias else -1, top_n, m)
    assert_same(got, want)


@pytest.mark.parametrize("B", [8, 9, 16, 17, 32, 40, 64, 65, 70])  # groups of 8, 16, 32, 64 (full and not), two
# groups (65: the second a lone request, whose bit per ref starts past the first group's truth)
def test_cpu_match_of_wide_batches(B):
    gen = torch.Generator().manual_seed(B)
    status, start, end, refs, _, _ = make_table(gen, 301, 4, 1, torch.float32)
    now, truth, *_ = make_requests(gen, B, 1, 1, 0)
    assert torch.equal(cpu.clause_match(status, start, end, refs, truth, now),
                       reference.clause_match(status, start, end, refs, truth, now))


@pytest.mark.parametrize("B, E, D, G, top_n", [
    (9, 6, 64, 16, 2), (17, 2, 13, 5, 1), (33, 3, 7, 3, 3), (70, 6, 9, 7, 2),  # every word width, two groups
    (65, 6, 9, 7, 2),  # a lone request after a full group
    (8, 6, 8, 4, 2), (16, 6, 8, 4, 2), (32, 4, 8, 4, 2), (64, 6, 8, 4, 2),  # groups whose every bit is a request
    (3, 9, 11, 6, 2), (2, 16, 64, 16, 3),  # more than 8 experts: one dim per row
])
def test_cpu_scan_of_wide_batches_and_many_experts(B, E, D, G, top_n):
    gen = torch.Generator().manual_seed(B * 100 + E)
    table = make_table(gen, 301, 4, D + G + 1, torch.float16)
    requests = make_requests(gen, B, E, D, G)
    assert_same(cpu.fused_scan(*table, *requests, D + G, top_n, 20),
                reference.fused_scan(*table, *requests, D + G, top_n, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_cpu_scan_skips_only_ads_that_cannot_enter_the_top(dtype):
    """Once a request's heap is full, an ad whose largest usable similarity plus its bias is below the heap's worst
    is not mixed (AVX-512 and AVX2 builds): with 3,000 ads whose scores crowd around a few values (six rows, half of the ads an
    exact copy, biases included, half a copy moved by about 1e-3) and a top of 7, the top is still the
    reference's exactly."""
    gen = torch.Generator().manual_seed(5)
    n, D, G = 3000, 16, 8
    status, start, end, refs, vectors, scales = make_table(gen, n, 2, D + G + 1, dtype)
    rows, moved = torch.randint(0, 6, (n,), generator=gen), torch.rand((n, 1), generator=gen) < 0.5
    vectors = vectors[:6][rows]
    if scales is None:
        vectors = (vectors.float() + moved * 1e-3 * torch.randn(vectors.shape, generator=gen)).to(dtype)
    else:
        scales = scales[:6][rows] * (1 + moved * 1e-3 * torch.randn(scales[:6][rows].shape, generator=gen))
    requests = make_requests(gen, 3, 6, D, G)
    table = (status, start, end, refs, vectors, scales)
    assert_same(cpu.fused_scan(*table, *requests, D + G, 2, 7), reference.fused_scan(*table, *requests, D + G, 2, 7))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cpu_scan_skips_on_the_usable_similarities_that_are_numbers(monkeypatch):
    """One slot range, a top of 3: after the first three ads every ad with numbers for similarities falls below the bar
    and is skipped; one whose similarities are (NaN, inf) is not, whether its chosen expert is the infinite one (slot
    36: it leads with 15 and 35, whose (inf, NaN) has the NaN unchosen) or the NaN one (slot 37: -inf, as in the
    reference). A skip test that let a NaN hide the other similarities would drop slot 36."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    n = 40
    status, start, end, refs = servable_table(n)
    inf = float("inf")
    vectors = torch.tensor([[0.9 - 0.01 * i, 0.1, 1.0, 0.0, 0.0] for i in range(n)])  # a (2), q (2), bias
    for slot, a, q in [(15, (inf, inf), (1, 0)), (35, (inf, inf), (1, 0)), (36, (inf, -inf), (0, 1)),
                       (37, (inf, -inf), (1, 0))]:
        vectors[slot, :4] = torch.tensor([*a, *q])
    experts = torch.tensor([[[1.0, 1.0], [1.0, -1.0]]])  # similarities a0 + a1 and a0 - a1
    keys = torch.eye(2).unsqueeze(0)  # logits q: the larger one's expert is chosen
    now, truth, mask = torch.full((1,), NOW), torch.zeros((1, W), dtype=torch.int32), torch.ones((1, 2), dtype=torch.bool)
    args = (status, start, end, refs, vectors, None, now, truth, experts, keys, mask, 4, 1, 3)
    got = cpu.fused_scan(*args)
    assert_same(got, reference.fused_scan(*args))
    assert got[0][0].tolist() == [15, 35, 36]


@pytest.mark.parametrize("tasks_per_thread", [1, 3])
def test_cpu_scan_merges_the_heaps_of_many_slot_ranges(monkeypatch, tasks_per_thread):
    """Whatever the machine's threads, 7 and 21 slot ranges (each with heaps of min(m, its slots) places) merge into
    the reference's top: m below and above a range's size, ties included."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    monkeypatch.setattr(cpu, "TASKS_PER_THREAD", tasks_per_thread)
    gen = torch.Generator().manual_seed(41)
    status, start, end, refs, vectors, scales = make_table(gen, 500, 3, 21, torch.float16)
    vectors[::3] = vectors[1]  # a third of the ads score alike
    requests = make_requests(gen, 3, 6, 12, 8)
    for m in (5, 60):
        assert_same(cpu.fused_scan(status, start, end, refs, vectors, scales, *requests, 20, 2, m),
                    reference.fused_scan(status, start, end, refs, vectors, scales, *requests, 20, 2, m))


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-fma -mno-f16c"])
def test_cpu_kernels_without_avx512_or_avx2(flags):
    """The other paths of cpu_fused.cpp: the AVX2 one (a CPU without AVX-512) and the portable loops (without AVX2,
    FMA or F16C)."""
    env = {**os.environ, "ANDROMEDA_CXXFLAGS": flags}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "cpu and (equals_reference or wide_batches or every_rule or ties or nan or zero_scores or skips)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]  # 5 when nothing was collected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_request_sides_far_from_float16s_range(kernel, dtype):
    """Experts and keys above float16's largest value (65504) and below its subnormals, far apart from each other
    (the Triton pass splits them into float16 parts, each expert and each request's keys scaled by a power of two
    first): request 0 mixes all experts, requests 1 and 2 score by one tiny expert alone, so its scores alone
    order the slots."""
    gen = torch.Generator().manual_seed(31)
    n, D, G = 301, 64, 16
    status, start, end, refs, vectors, scales = make_table(gen, n, 4, D + G + 1, dtype)
    now, truth, experts, keys, mask = make_requests(gen, 3, 6, D, G)
    experts = experts * torch.tensor([1e6, 1e-9, 1.0, 7e4, 3e-6, 1e-30])[:, None]
    keys = keys * torch.tensor([1e5, 1e-7, 1.0])[:, None, None]
    mask[0], mask[1:] = True, False
    mask[1, 1] = mask[2, 5] = True
    got, want = both(kernel, status, start, end, refs, vectors, scales, now, truth, experts, keys, mask, -1, 2, 40)
    assert_same(got, want)
    assert (want[1][1:].abs() < 1e-6).all() and (want[1][1:, 1:] != want[1][1:, :-1]).all()


def test_request_side_goes_up_in_one_buffer_at_aligned_offsets():
    tensors = (torch.randn(3, 5).half(), torch.arange(7, dtype=torch.int8), torch.randn(2, 3, 4), torch.randn(1))
    got = fused.upload(tensors, DEVICE)
    base = got[0].data_ptr()
    for want, t in zip(tensors, got):
        assert t.dtype == want.dtype and torch.equal(t.cpu(), want)
        assert (t.data_ptr() - base) % 128 == 0 and t.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()


def test_merge_rounds(monkeypatch):
    """A small merge tile folds the partials over several rounds (Triton)."""
    kernel = KERNELS["triton"]
    monkeypatch.setattr(fused, "MERGE_TILE", 32)
    gen = torch.Generator().manual_seed(3)
    status, start, end, refs, vectors, scales = make_table(gen, 1000, 2, 80, torch.float32)
    requests = make_requests(gen, 2, 6, 64, 16)
    for m in (10, 200):
        got, want = both(kernel, status, start, end, refs, vectors, scales, *requests, -1, 2, m)
        assert_same(got, want)


class NotCalled:
    def __getitem__(self, grid):
        raise AssertionError("the merge kernel was launched")


@pytest.mark.parametrize("n", [700, 400])  # 400: fewer partial keys (4 blocks) than m, padded after topk
def test_a_long_shortlist_merges_in_torch(monkeypatch, n):
    """Past MERGE_MAX_K keys per request the merge is torch.topk over every partial key, not a kernel program
    (Triton): the same top-m, fewer eligible ads than m padded."""
    kernel = KERNELS["triton"]
    monkeypatch.setattr(fused, "MERGE_MAX_K", 64)
    monkeypatch.setattr(fused, "_merge_kernel", NotCalled())
    gen = torch.Generator().manual_seed(4)
    status, start, end, refs, vectors, scales = make_table(gen, n, 2, 80, torch.float16)
    requests = make_requests(gen, 2, 6, 64, 16)
    got, want = both(kernel, status, start, end, refs, vectors, scales, *requests, -1, 2, 650)
    assert_same(got, want)
    assert (want[0] == -1).any()  # fewer eligible than m: padding compared too


def merge_widths(monkeypatch) -> list[int]:
    """The key widths the Triton merge is called with from now on: BLOCK after the threshold scan's candidates,
    less (the next power of two of m) after the fallback's per-block top-m."""
    widths, merge = [], fused.merge_partials
    monkeypatch.setattr(fused, "merge_partials", lambda partial, m: (widths.append(partial.shape[2]), merge(partial, m))[1])
    return widths


@pytest.mark.parametrize("n, B, dtype, m, stride", [
    (1000, 3, torch.float16, 5, 1),
    (1000, 2, torch.int8, 3, 2),  # every other block sampled
    (1001, 1, torch.float32, 8, 1),  # m = the blocks sampled
    (1000, 5, torch.float16, 5, 1),  # past MATCHED_ROWS_MAX_B (as B = 2 and 3): every row of a block loaded
])
def test_threshold_scan_equals_reference(monkeypatch, n, B, dtype, m, stride):
    """The threshold scan (tau from sampled blocks' best keys, then only keys >= tau kept) returns the reference's
    top-m (Triton)."""
    widths = merge_widths(monkeypatch)
    gen = torch.Generator().manual_seed(n + m)
    table = make_table(gen, n, 4, 83, dtype)
    requests = make_requests(gen, B, 6, 64, 16)
    assert_same(triton_scan(*table, *requests, 82, 2, m, stride), reference.fused_scan(*table, *requests, 82, 2, m))
    assert widths[0] == fused.BLOCK


def test_threshold_scan_falls_back_when_candidates_overflow(monkeypatch):
    """Tied scores (zero experts: every score is exactly 0): the sampled blocks' best keys are their first slots, so
    every slot of the first m blocks reaches tau; with room for one block of candidates the scan keeps per-block
    top-m instead (Triton)."""
    widths = merge_widths(monkeypatch)
    monkeypatch.setattr(fused, "CANDIDATES", 1)
    monkeypatch.setattr(fused, "MIN_CANDIDATES", 1)
    n, m = 1000, 4
    gen = torch.Generator().manual_seed(5)
    now, truth, experts, keys, mask = make_requests(gen, 2, 1, 8, 0)
    args = (*servable_table(n), torch.randn((n, 8), generator=gen), None, now, truth, torch.zeros_like(experts), keys,
            mask, -1, 1, m)
    got = triton_scan(*args, 1)
    assert_same(got, reference.fused_scan(*args))
    assert got[0].tolist() == [[0, 1, 2, 3]] * 2 and widths == [triton.next_power_of_2(m)]


def test_threshold_scan_with_no_eligible_slot(monkeypatch):
    widths = merge_widths(monkeypatch)
    gen = torch.Generator().manual_seed(29)
    status, start, end, refs, vectors, scales = make_table(gen, 700, 3, 40, torch.float32)
    requests = make_requests(gen, 2, 1, 37, 0)
    got = triton_scan(torch.zeros_like(status), start, end, refs, vectors, scales, *requests, 39, 1, 3, 1)
    assert (got[0] == -1).all() and (got[1] == float("-inf")).all() and (got[2] == 0).all()
    assert widths == [fused.BLOCK]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_threshold_scan_skips_the_gating_of_blocks_below_tau(monkeypatch, dtype):
    """Blocks whose largest usable similarity plus bias stays under tau skip their gating and keys: the answer is
    still the reference's, every block holding one of the top-m was scored, and some were not (Triton). The last
    request has no usable expert: its scores are the biases, the bound is exact, and it scores m blocks (every block
    is sampled, so tau is the m-th best of the blocks' best keys: m blocks reach it)."""
    gen = torch.Generator().manual_seed(31)
    n, m = 2000, 3
    status, start, end, refs, vectors, scales = make_table(gen, n, 3, 83, dtype)
    requests = make_requests(gen, 2, 6, 64, 16)
    stats = {}
    got = [t.cpu() for t in fused.fused_scan(*on_device((status, start, end, refs, vectors, scales, *requests)),
                                             82, 2, m, 1, stats)]
    assert_same(got, reference.fused_scan(status, start, end, refs, vectors, scales, *requests, 82, 2, m))
    assert stats["path"] == "threshold" and stats["blocks"] == 16
    scored = stats["scored"].cpu()
    holding = torch.tensor([len(set((row // fused.BLOCK).tolist())) for row in got[0]])
    assert (scored >= holding).all() and (scored < stats["blocks"]).all() and scored[-1] == m, scored
    monkeypatch.setattr(fused, "SKIP_BELOW_TAU", False)  # the A/B switch: every block with an eligible slot is scored
    unskipped = [t.cpu() for t in fused.fused_scan(*on_device((status, start, end, refs, vectors, scales, *requests)),
                                                   82, 2, m, 1, stats)]
    assert_same(unskipped, got)
    assert stats["scored"].tolist() == [stats["blocks"]] * 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaNs
@pytest.mark.parametrize("matched_rows_max_b", [4, 0])  # only the matched rows loaded, or every row
def test_threshold_scan_with_nan_and_infinite_values_equals_reference(monkeypatch, matched_rows_max_b):
    """NaN and infinite similarities and biases in the threshold scan's skip test, then a tau whose score is -inf
    (every bias but two -inf): the answers are the reference's (Triton)."""
    monkeypatch.setattr(fused, "MATCHED_ROWS_MAX_B", matched_rows_max_b)
    gen = torch.Generator().manual_seed(37)
    n, m = 1500, 4
    status, start, end, refs = servable_table(n)
    vectors = torch.randn((n, 9), generator=gen)
    vectors[[5, 700, 1300], 0] = float("nan")
    vectors[[6, 900], 1] = float("inf")
    vectors[[7, 1100], 8] = float("nan")  # the bias column
    vectors[[8, 1200], 8] = float("-inf")
    requests = make_requests(gen, 2, 2, 4, 4)
    args = (status, start, end, refs, vectors, None, *requests, 8, 1, m)
    stats = {}
    got = [t.cpu() for t in fused.fused_scan(*on_device(args), 1, stats)]
    assert_same(got, reference.fused_scan(*args))
    assert stats["path"] == "threshold"
    vectors[:, 8] = float("-inf")  # fewer finite scores than m: tau's score is -inf, and so are the others'
    vectors[[100, 1000], 8] = 1.0
    args = (status, start, end, refs, vectors, None, *requests, 8, 1, m)
    got = [t.cpu() for t in fused.fused_scan(*on_device(args), 1, stats)]
    assert_same(got, reference.fused_scan(*args))
    assert stats["path"] == "threshold" and got[0][:, 2:].tolist() == [[0, 1]] * 2


def test_a_per_block_scan_too_large_for_one_pass_runs_the_requests_in_parts(monkeypatch):
    """Past PER_BLOCK_BYTES of partials the per-block scan takes the requests in parts (Triton): the same answers."""
    gen = torch.Generator().manual_seed(41)
    table = make_table(gen, 300, 3, 21, torch.int8)  # 3 blocks, the last partial
    requests = make_requests(gen, 5, 6, 12, 8)
    args = (*table, *requests, 20, 2, 9)
    whole = [t.cpu() for t in fused.fused_scan(*on_device(args), 0)]
    width = min(triton.next_power_of_2(9), fused.BLOCK)
    monkeypatch.setattr(fused, "PER_BLOCK_BYTES", 2 * triton.cdiv(300, fused.BLOCK) * width * 8)  # 2 requests a part
    batches, scan = [], fused.fused_scan
    monkeypatch.setattr(fused, "fused_scan", lambda *a, **kw: batches.append(a[6].shape[0]) or scan(*a, **kw))
    stats: dict = {}
    parts = [t.cpu() for t in fused.fused_scan(*on_device(args), 0, stats)]
    assert batches == [5, 2, 2, 1]
    assert_same(parts, reference.fused_scan(*args))
    assert all(torch.equal(a, b) for a, b in zip(parts, whole)) and stats["path"] == "per-block"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_ties_order_by_slot(kernel, dtype):
    """Three distinct rows repeated: each score is tied across the blocks and m cuts inside a tie."""
    gen = torch.Generator().manual_seed(7)
    n, S = 301, 37
    _, _, _, _, rows, row_scales = make_table(gen, 3, 1, S, dtype)
    vectors = rows[torch.arange(n) % 3]
    scales = None if row_scales is None else row_scales[torch.arange(n) % 3]
    now, truth, experts, keys, mask = make_requests(gen, 2, 4, 16, 16)
    got, want = both(kernel, *servable_table(n), vectors, scales, now, truth, experts, keys, mask, 36, 2, 150)
    assert_same(got, want)
    tied = got[1][:, 1:] == got[1][:, :-1]
    assert tied.sum() >= 2 * 148 and (got[0][:, 1:] > got[0][:, :-1])[tied].all()


def test_equal_rows_score_alike_in_every_slot_so_they_tie_by_slot(kernel):
    """83 equal rows, every expert gated: the reference summed its experts with .sum(1), which rounded slots 64-82
    1 ulp apart from the rest, so it put them first while the kernel ordered the tie by slot (a review's fuzz)."""
    gen = torch.Generator().manual_seed(17)
    n, E = 83, 6
    vectors = torch.randint(-2, 3, (1, 4), generator=gen).float().repeat(n, 1)
    experts = torch.randint(-2, 3, (1, E, 2), generator=gen).float()
    keys = torch.randint(-1, 2, (1, E, 2), generator=gen).float()
    mask = torch.ones((1, E), dtype=torch.bool)
    assert reference.head_scores(vectors, None, experts, keys, mask, -1, E).unique().numel() == 1
    got, want = both(kernel, *servable_table(n), vectors, None, torch.tensor([NOW]), torch.zeros((1, 1), dtype=torch.int32),
                     experts, keys, mask, -1, E, 3)
    assert_same(got, want)
    assert want[0].tolist() == [[0, 1, 2]]


def test_no_eligible_slot(kernel):
    gen = torch.Generator().manual_seed(11)
    status, start, end, refs, vectors, scales = make_table(gen, 301, 3, 40, torch.float32)
    status = torch.zeros_like(status)
    requests = make_requests(gen, 3, 1, 37, 0)
    got, want = both(kernel, status, start, end, refs, vectors, scales, *requests, 39, 1, 12)
    assert_same(got, want)
    assert (got[0] == -1).all() and (got[1] == float("-inf")).all() and (got[2] == 0).all()


def test_nan_scores_rank_after_the_finite_and_before_the_ineligible(kernel):
    gen = torch.Generator().manual_seed(13)
    n = 37
    status, start, end, refs = servable_table(n)
    status[[0, 5]] = 0
    vectors = torch.randn((n, 8), generator=gen)
    vectors[[3, 10]] = float("nan")
    requests = make_requests(gen, 1, 1, 8, 0)
    got, want = both(kernel, status, start, end, refs, vectors, None, *requests, -1, 1, n + 3)
    assert_same(got, want)
    assert got[0][0, n - 4:].tolist() == [3, 10] + [-1] * 5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaNs
def test_nan_or_infinite_logits_leave_the_bias_and_gate_0_experts_add_nothing(kernel):
    """A NaN or +inf gating logit makes every gate 0 (the score is the bias alone); an expert with gate 0 adds
    nothing even when its similarity is infinite, whether it was not chosen (request 0) or not usable (request 1)."""
    n, D, G = 5, 2, 2
    status, start, end, refs = servable_table(n)
    inf, nan = float("inf"), float("nan")
    vectors = torch.tensor([[1.0, 0.5, 0.2, 0.1, 0.3], [1.0, 0.5, nan, 0.1, 0.4], [1.0, 0.5, inf, inf, 0.5],
                            [0.5, 1.0, 0.3, 0.2, 0.6], [-1.0, 2.0, 0.1, 0.9, 0.7]])  # a, q, bias
    experts = torch.tensor([[[1.0, 2.0], [0.5, -1.0], [inf, 1.0]]]).repeat(2, 1, 1)
    keys = torch.tensor([[[1.0, 1.0], [2.0, 0.5], [0.1, 0.1]],  # expert 2 has the lowest logit: never in the top 2
                         [[1.0, 1.0], [2.0, 0.5], [9.0, 9.0]]])  # the highest, but not usable
    mask = torch.tensor([[True, True, True], [True, True, False]])
    now, truth = torch.full((2,), NOW), torch.zeros((2, W), dtype=torch.int32)
    got, want = both(kernel, status, start, end, refs, vectors, None, now, truth, experts, keys, mask, D + G, 2, n)
    assert_same(got, want)
    for slots, scores in zip(want[0].tolist(), want[1].tolist()):
        by_slot = dict(zip(slots, scores))
        assert by_slot[1] == pytest.approx(0.4) and by_slot[2] == pytest.approx(0.5)
        assert all(math.isfinite(v) for v in scores)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_gated_sum_equals_reference_at_float32s_edges(kernel):
    """The gates are normalised before the gated sum, as in the reference. Request 0 (two experts, equal logits):
    similarities of 2e38 and 3e38 score 0.5 x s + 0.5 x s = s, where the sum of the weighted similarities before
    dividing by the weights' total overflowed to inf. Requests 1 and 2 (logits 0, 0 and -103.5 for slot 0): the
    third expert's softmax weight exp(-103.5) is a float32 subnormal, but its gate (half of it) rounds to 0, so its
    similarity (inf, or NaN) adds nothing."""
    inf = float("inf")
    status, start, end, refs = servable_table(3)
    vectors = torch.tensor([[2e19, 0.0, 1.0], [3e19, 0.0, 2.0], [1.0, 0.5, 0.5]])  # a (D = 2), q (G = 1)
    experts = torch.tensor([[[1e19, 0.0], [1e19, 0.0], [0.0, 0.0]],
                            [[1e-19, 1.0], [1e-19, 1.0], [inf, 0.0]],  # slot 0: similarities 2, 2, inf
                            [[1e-19, 1.0], [1e-19, 1.0], [inf, -inf]]])  # slot 0: 2, 2, NaN
    keys = torch.tensor([[[1.0], [1.0], [0.0]], [[0.0], [0.0], [-103.5]], [[0.0], [0.0], [-103.5]]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    now, truth = torch.full((3,), NOW), torch.zeros((3, W), dtype=torch.int32)
    got, want = both(kernel, status, start, end, refs, vectors, None, now, truth, experts, keys, mask, -1, 3, 3)
    assert_same(got, want)
    assert want[0][0, :2].tolist() == [1, 0] and want[1][0, :2].tolist() == pytest.approx([3e38, 2e38])
    for slots, scores in zip(want[0][1:].tolist(), want[1][1:].tolist()):
        assert dict(zip(slots, scores))[0] == pytest.approx(2.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_one_expert_with_gating_dims_is_gated(kernel):
    """E = 1 with G > 0: the expert's gate is 1, or 0 (the bias alone) where its logit is NaN or +inf."""
    n = 4
    status, start, end, refs = servable_table(n)
    vectors = torch.tensor([[1.0, 2.0, 0.5, 0.1], [1.0, 2.0, float("inf"), 0.2], [1.0, 2.0, float("nan"), 0.3],
                            [2.0, 1.0, -3.0, 0.4]])  # a (2), q (1), bias
    got, want = both(kernel, status, start, end, refs, vectors, None, torch.full((1,), NOW),
                     torch.zeros((1, W), dtype=torch.int32), torch.tensor([[[1.0, 1.0]]]), torch.tensor([[[1.0]]]),
                     torch.tensor([[True]]), 3, 1, n)
    assert_same(got, want)
    assert got[0].tolist() == [[3, 0, 2, 1]] and got[1][0].tolist() == pytest.approx([3.4, 3.1, 0.3, 0.2])


@pytest.mark.parametrize("m, top_n", [(0, 1), (5, 0)])
@pytest.mark.parametrize("scan", [cpu.fused_scan, dispatch.fused_scan])
def test_scans_refuse_an_empty_top(scan, m, top_n):
    table = make_table(torch.Generator().manual_seed(0), 10, 2, 5, torch.float32)
    with pytest.raises(ValueError, match="at least 1"):
        scan(*table, *make_requests(torch.Generator().manual_seed(1), 2, 2, 2, 2), -1, top_n, m)


@pytest.mark.parametrize("scan", [cpu.fused_scan, dispatch.fused_scan])
def test_scans_refuse_tables_with_less_than_the_head_reads(scan):
    """Rows narrower than D + G or the bias column, int8 vectors without scales or with fewer scale blocks than the
    dims read: a ValueError, where the compiled kernel read past the tensors (no scales: the process died)."""
    status, start, end, refs, vectors, scales = make_table(torch.Generator().manual_seed(0), 10, 2, 40, torch.int8)
    requests = make_requests(torch.Generator().manual_seed(1), 2, 2, 30, 5)
    for vectors_, scales_, bias_col, match in [(vectors, None, -1, "need scales"), (vectors, scales[:, :2], -1, "3 blocks"),
                                               (vectors[:, :34], scales, -1, "34"), (vectors, scales, 40, "41 columns")]:
        with pytest.raises(ValueError, match=match):
            scan(status, start, end, refs, vectors_, scales_, *requests, bias_col, 1, 3)
    assert scan(status, start, end, refs, vectors, scales, *requests, 39, 1, 3)[0].shape == (2, 3)


@pytest.mark.parametrize("error", ["OutOfResources", "PTXASError"])
def test_a_head_the_gpu_cannot_build_is_scored_by_the_reference_tried_once(monkeypatch, caplog, error):
    """Triton meets a head too large for the GPU at its first launch: the dispatcher answers with the reference,
    warns once naming the head, and does not try to build it again; other heads still run on Triton."""
    from triton.runtime import errors

    monkeypatch.setattr(dispatch, "UNBUILDABLE", set())
    tries = []

    def too_large():
        tries.append(1)
        raise errors.OutOfResources(237056, 232448, "shared memory") if error == "OutOfResources" else \
            errors.PTXASError("Register allocation failed")

    head = (torch.int8, 16, 128, 16)
    with caplog.at_level("WARNING", logger="kernels.dispatch"):
        assert [dispatch.built_or_reference(too_large, lambda: "reference", head) for _ in range(3)] == ["reference"] * 3
    assert tries == [1] and dispatch.UNBUILDABLE == {head}
    assert caplog.text.count("cannot build") == 1 and "torch.int8 table with 16 experts, D = 128" in caplog.text
    assert dispatch.built_or_reference(lambda: "triton", lambda: "reference", (torch.float16, 16, 128, 16)) == "triton"
    with pytest.raises(ValueError):  # anything else is no build failure: it surfaces
        dispatch.built_or_reference(lambda: int("x"), lambda: "reference", (torch.float16, 4, 64, 16))


def test_the_fallback_reference_runs_a_large_batch_in_parts(monkeypatch):
    """A head the GPU cannot build is scored by the reference a few requests at a time, within REFERENCE_BYTES of
    intermediates: the same answers as in one pass."""
    gen = torch.Generator().manual_seed(29)
    table = make_table(gen, 203, 3, 21, torch.int8)
    requests = make_requests(gen, 5, 6, 12, 8)
    want_scan = reference.fused_scan
    want = want_scan(*table, *requests, 20, 2, 7)
    monkeypatch.setattr(dispatch, "REFERENCE_BYTES", 2 * 14 * 6 * 203)  # two requests a part: 2 + 2 + 1
    parts = []
    monkeypatch.setattr(reference, "fused_scan", lambda *a: parts.append(a[6].shape[0]) or want_scan(*a))
    got = dispatch.reference_in_parts(*table, *requests, 20, 2, 7)
    assert parts == [2, 2, 1] and all(torch.equal(a, b) for a, b in zip(got, want))


def test_cpu_scan_of_no_request():
    table = make_table(torch.Generator().manual_seed(0), 10, 2, 5, torch.float32)
    now, truth, experts, keys, mask = make_requests(torch.Generator().manual_seed(1), 1, 2, 2, 2)
    got = cpu.fused_scan(*table, now[:0], truth[:0], experts[:0], keys[:0], mask[:0], -1, 1, 4)
    want = reference.fused_scan(*table, now[:0], truth[:0], experts[:0], keys[:0], mask[:0], -1, 1, 4)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want] == [(0, 4), (0, 4), (0,)]


def test_zero_scores_tie_whatever_their_sign(kernel):
    """No usable expert and no bias: every score is 0 * sim, +0.0 or -0.0, and all tie."""
    gen = torch.Generator().manual_seed(23)
    n = 37
    now, truth, experts, keys, mask = make_requests(gen, 1, 1, 8, 0)
    got, want = both(kernel, *servable_table(n), torch.randn((n, 8), generator=gen), None, now, truth, experts, keys,
                     ~mask, -1, 1, 20)
    assert_same(got, want)
    assert got[0][0].tolist() == list(range(20))


def test_vectors_may_be_a_strided_view(kernel):
    gen = torch.Generator().manual_seed(17)
    status, start, end, refs, wide, _ = make_table(gen, 37, 2, 60, torch.float16)
    requests = make_requests(gen, 2, 3, 16, 16)
    got, want = both(kernel, status, start, end, refs, wide[:, 5:40], None, *requests, 34, 2, 9)
    assert_same(got, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 400), B=st.integers(1, 4), C=st.integers(1, 10), dtype=st.sampled_from([torch.float32, torch.float16, torch.int8]),
       E=st.integers(1, 6), D=st.integers(1, 40), G=st.integers(0, 20), top_n=st.integers(1, 4), bias=st.booleans(),
       m=st.integers(1, 64), seed=st.integers(0, 2**31))
def test_cpu_scan_equals_reference_on_drawn_tables(n, B, C, dtype, E, D, G, top_n, bias, m, seed):
    gen = torch.Generator().manual_seed(seed)
    table = make_table(gen, n, C, D + G + 1, dtype)
    requests = make_requests(gen, B, E, D, G)
    assert_same(cpu.fused_scan(*table, *requests, D + G if bias else -1, top_n, m),
                reference.fused_scan(*table, *requests, D + G if bias else -1, top_n, m))


def compile_for_sm90():
    """Compiles the kernels ahead for an H100 / H200 (sm_90), no GPU needed, specialised as a launch specialises them
    (unit strides as constants, pointers 16-byte aligned), and prints ptxas' resource use of each (its STACK is the
    bytes spilled) and its count of SASS instructions: run in a process without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton import match

    pointers = {"status_ptr": "*i8", "start_ptr": "*i64", "end_ptr": "*i64", "refs_ptr": "*i32", "now_ptr": "*i64",
                "truth_ptr": "*i32", "usable_ptr": "*i8", "unscale_ptr": "*fp32", "key_unscale_ptr": "*fp32",
                "scale_ptr": "*fp32", "part_ptr": "*i64", "eligible_ptr": "*i64", "counts_ptr": "*i64",
                "mask_ptr": "*i8", "src_ptr": "*i64", "dst_ptr": "*i64", "slots_ptr": "*i64", "scores_ptr": "*fp32",
                "tau_ptr": "*i64", "count_ptr": "*i32", "scored_ptr": "*i32"}
    head = dict(C=4, STRIDE_R=4, CP=4, D=64, DW=64, G=16, G0=64, GW=16, EP=8, TOP_N=2, BIAS_COL=112, BLOCK=fused.BLOCK,
                STRIDE_V=113, STRIDE_S=8, SKIP=True, MATCHED_ROWS=False)  # 4 refs, a row of S = 113 vector columns: D = 64,
    # G = 16, bias at 112

    def scan(vec, **constants):
        operand = "*fp32" if vec == "*fp32" else "*fp16"  # fused.mma_operand
        types = dict(vec_ptr=vec, **{name: operand for name in ("experts_hi_ptr", "experts_lo_ptr", "keys_hi_ptr",
                                                                 "keys_lo_ptr")})
        return fused._scan_kernel, types, dict(head, **constants), fused.SCAN_WARPS

    builds = [scan(vec, WIDTH=width, KEEP=keep)
              for vec, width, keep in (("*fp32", 16, 0), ("*fp16", 16, 0), ("*i8", 16, 0), ("*i8", fused.BLOCK, 0),
                                       ("*fp16", 1, 1), ("*fp16", 1, 2), ("*i8", 1, 2))]
    builds += [scan(vec, WIDTH=width, KEEP=keep, MATCHED_ROWS=True)  # small batches: only the matched rows loaded
               for vec, width, keep in (("*fp16", 16, 0), ("*fp16", 1, 2), ("*i8", 1, 2))]
    builds += [scan("*fp16", WIDTH=1, KEEP=2, STRIDE_V=128, MATCHED_ROWS=masked)  # rows padded to 256 bytes, as an
               for masked in (False, True)]  # AdIndex lays them out: the vector loads can be 128-bit
    builds += [scan("*fp16", G=0, TOP_N=1, WIDTH=16, KEEP=0),  # the dot product (E = 1)
               scan("*i8", D=40, G0=32, GW=32, BIAS_COL=-1, WIDTH=1, KEEP=2),  # q's tile over two scale blocks
               (fused._merge_kernel, {}, dict(W_IN=128, FAN=16, K=256, FINAL=False), 4),
               (fused._merge_kernel, {}, dict(W_IN=256, FAN=8, K=256, FINAL=True), 4),
               (match._match_kernel, {}, dict(C=4, STRIDE_R=4, CP=4, BLOCK=match.BLOCK), 4)]
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    for fn, types, constants, warps in builds:
        types = dict(pointers, **types)
        signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if signature[name].startswith("*")}
        kernel = triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        with tempfile.TemporaryDirectory() as folder:
            cubin = pathlib.Path(folder) / "kernel.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage, sass = (subprocess.run([cuobjdump, dump, cubin], capture_output=True, text=True, check=True).stdout
                           for dump in ("--dump-resource-usage", "--dump-sass"))
        instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?!NOP)\S", sass, re.M))
        print(fn.__name__, types.get("vec_ptr"), constants, re.search(r"REG:\d+ STACK:\d+", usage).group(),
              f"SHARED:{kernel.metadata.shared} SASS:{instructions} LDG128:{len(re.findall(r'LDG[.]E[.]128', sass))}")


def test_kernels_compile_for_sm90_without_spills():
    """The interpreter accepts what a GPU compiler rejects (dot sizes under 16, ...): compile for sm_90 with the
    ptxas that comes with Triton, and keep the registers from spilling and the shared memory within what a block may
    have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", "from tests.kernels.test_fused_kernels import compile_for_sm90; "
                          "compile_for_sm90()"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    spilled = re.findall(r"STACK:(\d+)", run.stdout)
    assert len(spilled) == 17 and set(spilled) == {"0"}, run.stdout
    shared = [int(b) for b in re.findall(r"SHARED:(\d+)", run.stdout)]  # within sm_90's 227 KB a block may opt in to
    assert len(shared) == 17 and max(shared) <= 227 * 1024, run.stdout
    wide = re.findall(r"'STRIDE_V': 128.*'MATCHED_ROWS': (\w+).*LDG128:(\d+)", run.stdout)  # the row mask keeps
    assert len(wide) == 2 and wide[0][1] == wide[1][1] != "0", wide  # every vector load as wide as without it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernels at realistic sizes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("m", [200, 20])  # 782 blocks: the per-block top-m (48 sampled < 200), the threshold scan
def test_fused_scan_on_cuda_at_realistic_sizes(dtype, m):
    """On the GPU, scores within float tolerance may order near-ties differently: each returned slot must carry its
    reference score."""
    gen = torch.Generator().manual_seed(19)
    n, B, D, G = 100_003, 16, 64, 16
    table = [t if t is None else t.cuda() for t in make_table(gen, n, 4, D + G + 1, dtype)]
    requests = [t.cuda() for t in make_requests(gen, B, 6, D, G)]
    slots, scores, eligible = fused.fused_scan(*table, *requests, D + G, 2, m)
    want_slots, want_scores, want_eligible = reference.fused_scan(*table, *requests, D + G, 2, m)
    assert torch.equal(eligible, want_eligible)
    assert torch.equal(slots < 0, want_slots < 0)
    torch.testing.assert_close(scores, want_scores, rtol=1e-4, atol=1e-5)
    status, start, end, refs, vectors, scales = table
    now, truth, experts, keys, mask = requests
    ok = reference.clause_match(status, start, end, refs, truth, now)
    full = reference.head_scores(vectors, scales, experts, keys, mask, D + G, 2)
    found = slots.clamp(min=0)
    assert ok.gather(1, found)[slots >= 0].all()
    torch.testing.assert_close(full.gather(1, found)[slots >= 0], want_scores[slots >= 0], rtol=1e-4, atol=1e-5)
    assert all(row[row >= 0].unique().numel() == int((row >= 0).sum()) for row in slots)
    got, counts = clause_match_count(status, start, end, refs, truth, now)
    assert torch.equal(got, ok) and torch.equal(counts, want_eligible)


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records the compile-time signature of every launch (its constexprs and
    num_warps, which of 1, a multiple of 16 or neither each integer it specialises on is, and which pointers are
    16-byte aligned: Triton compiles once per signature), then launches the kernel."""

    def __init__(self, kernel, launched: set):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **constants):
            ints = tuple(name for name, value in zip(self.kernel.arg_names, args)
                         if isinstance(value, int) and name not in fused.UNSPECIALISED[self.kernel.__name__]
                         for name in [f"{name}={'1' if value == 1 else '16k' if value % 16 == 0 else 'n'}"])
            aligned = tuple(name for name, value in zip(self.kernel.arg_names, args)
                            if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0)
            self.launched.add((self.kernel.__name__, ints, aligned, tuple(sorted(constants.items()))))
            return self.kernel[grid](*args, **constants)
        return launch


@pytest.mark.parametrize("sampled", [1, 3])  # 1: the threshold scan only at m = 1
def test_warm_up_launches_every_kernel_signature_later_passes_launch(monkeypatch, sampled):
    """After fused.warm_up over a table, passes over it launch no kernel signature warm_up did not (none waits for a
    compile): any m (the threshold scan at small m, the per-block one at larger m, merges of one and more rounds,
    torch's merge past MERGE_MAX_K), one request or several (warm_up sees one, as replicas warm up; B and m change
    the offsets of the threshold scan's buffers), a table grown by one slot, and one grown from too few slots for
    the threshold scan at warm_up. No launch asks tl.topk for 1 key (Triton 3.6, on the H100 image, cannot compile
    that; 3.9, here, can)."""
    launched: set = set()
    for name in ("_scan_kernel", "_merge_kernel"):
        monkeypatch.setattr(fused, name, LaunchRecorder(getattr(fused, name), launched))
    if DEVICE == "cpu":  # small blocks and merges, so that the interpreter gets through them in seconds
        for name, value in (("BLOCK", 16), ("SAMPLE_STRIDE", 4), ("MIN_CANDIDATES", 256), ("MERGE_MAX_K", 16),
                            ("MERGE_TILE", 64)):
            monkeypatch.setattr(fused, name, value)
    gen = torch.Generator().manual_seed(5)
    blocks = sampled * fused.SAMPLE_STRIDE + 1  # the threshold scan up to m = sampled, the per-block one beyond
    table = make_table(gen, blocks * fused.BLOCK + 5, 3, 21, torch.float16)
    requests = make_requests(gen, fused.MATCHED_ROWS_MAX_B + 2, 6, 12, 8)
    for small in (False, True) if sampled > 1 else (False,):  # a table too small for the threshold scan: once
        launched.clear()
        warmed_over = [None if t is None else t[:fused.BLOCK + 3] for t in table] if small else table
        fused.warm_up(*on_device(warmed_over), *on_device([r[:1] for r in requests]), 20, 2)
        warmed = set(launched)
        launched.clear()
        paths = set()
        for B in dict.fromkeys((1, 3, fused.MATCHED_ROWS_MAX_B, fused.MATCHED_ROWS_MAX_B + 2)):  # both ways of
            # loading rows (each batch size once: MATCHED_ROWS_MAX_B is 1 today)
            for m in (1, 2, 3, 9, 100):
                path: dict = {}
                fused.fused_scan(*on_device(table), *on_device([r[:B] for r in requests]), 20, 2, m, stats=path)
                paths.add(path["path"])
        assert paths == {"threshold", "per-block"}
        grown = [t[:-1] for t in table[:5]] + [table[5]]  # one slot fewer: other table sizes
        fused.fused_scan(*on_device(grown), *on_device(requests), 20, 2, 7)
        assert launched and launched <= warmed, (small, launched - warmed)
        for kernel, _, _, constants in warmed:
            constants = {name: getattr(value, "value", value) for name, value in constants}
            if kernel == "_merge_kernel" or constants["KEEP"] == fused.KEEP_TOP.value:
                assert constants["K" if kernel == "_merge_kernel" else "WIDTH"] >= 2, constants
        assert {kernel for kernel, _, _, _ in warmed} == {"_scan_kernel", "_merge_kernel"}
        assert {dict(constants)["MATCHED_ROWS"] for kernel, _, _, constants in warmed if kernel == "_scan_kernel"} == {
            True, False}


def dispatched_ops(table, requests, m=5):
    """The public ops over one table: both read the match's operands as raw pointers on the CPU."""
    status, start, end, refs, vectors, scales = table
    now, truth, experts, keys, mask = requests
    return (lambda: dispatch.fused_scan(*table, *requests, -1, 2, m),
            lambda: cpu.fused_scan(*table, *requests, -1, 2, m),
            lambda: dispatch.clause_match(status, start, end, refs, truth, now))


@pytest.mark.parametrize("name, change", [
    ("status", lambda t: t.long()), ("start", lambda t: t.int()), ("end", lambda t: t.int()),
    ("refs", lambda t: t.long()), ("truth", lambda t: t.long()), ("now", lambda t: t.int()),
    ("truth", lambda t: t[:, :0]), ("refs", lambda t: t[:-1]),
])
def test_operands_of_another_dtype_or_fewer_rows_are_refused_naming_them(name, change):
    """The compiled ops read raw pointers: int64 refs, int32 times and the like were read as other values or past
    their end (a review found wrong matches and reads past the buffers; truth of no column crashed the process)."""
    gen = torch.Generator().manual_seed(3)
    status, start, end, refs, vectors, scales = make_table(gen, 41, 3, 19, torch.float16)
    now, truth, experts, keys, mask = make_requests(gen, 2, 2, 8, 4)
    operands = dict(status=status, start=start, end=end, refs=refs, truth=truth, now=now)
    operands[name] = change(operands[name])
    table = (operands["status"], operands["start"], operands["end"], operands["refs"], vectors, scales)
    for op in dispatched_ops(table, (operands["now"], operands["truth"], experts, keys, mask)):
        with pytest.raises(ValueError, match=f"^{name}: "):
            op()


def test_a_head_with_fewer_rows_than_requests_is_refused():
    """experts of one row for four requests were read past their end (garbage scores) by the CPU kernel."""
    gen = torch.Generator().manual_seed(4)
    table = make_table(gen, 41, 3, 19, torch.float16)
    now, truth, experts, keys, mask = make_requests(gen, 4, 2, 8, 4)
    for short in ((now, truth, experts[:1], keys, mask), (now, truth, experts, keys[:1], mask),
                  (now, truth, experts, keys, mask[:1])):
        with pytest.raises(ValueError, match="a head of experts"):
            dispatched_ops(table, short)[0]()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_table_the_kernels_do_not_read_is_scanned_by_the_reference(dtype):
    """float64 and bfloat16 tables ended in a bare KeyError on the CPU; the reference reads them."""
    gen = torch.Generator().manual_seed(6)
    status, start, end, refs, vectors, _ = make_table(gen, 57, 3, 29, torch.float32)
    table = (status, start, end, refs, vectors.to(dtype), None)
    requests = make_requests(gen, 3, 6, 16, 8)
    got = dispatch.fused_scan(*table, *requests, 24, 2, 9)
    want = reference.fused_scan(*table, *requests, 24, 2, 9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_head_of_more_experts_than_the_cpu_kernel_holds_is_scored_by_the_reference():
    """17 experts on the CPU: the kernel holds 16 per register (kernels.cpu.LANES) and refuses more; the dispatcher
    answered with that ValueError (a review's fuzz), as it now answers with the reference."""
    gen = torch.Generator().manual_seed(8)
    table = make_table(gen, 57, 3, 29, torch.float32)
    requests = make_requests(gen, 2, cpu.LANES + 1, 16, 8)
    with pytest.raises(ValueError, match="at most 16 experts"):
        cpu.fused_scan(*table, *requests, 24, 2, 9)
    got, want = dispatch.fused_scan(*table, *requests, 24, 2, 9), reference.fused_scan(*table, *requests, 24, 2, 9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("top_n", [32768, 65536, 2 ** 40])
def test_top_n_above_the_experts_chooses_them_all_in_the_reference_too(top_n):
    """The reference compared an int16 count with top_n, which wrapped (32768 -> -32768): every gate 0, scores of the
    bias alone, where the CPU kernel clamps top_n to E."""
    gen = torch.Generator().manual_seed(7)
    table = make_table(gen, 61, 3, 29, torch.float32)
    requests = make_requests(gen, 2, 6, 16, 8)
    assert_same(cpu.fused_scan(*table, *requests, 24, top_n, 9), reference.fused_scan(*table, *requests, 24, top_n, 9))
    assert_same(reference.fused_scan(*table, *requests, 24, top_n, 9), reference.fused_scan(*table, *requests, 24, 6, 9))
