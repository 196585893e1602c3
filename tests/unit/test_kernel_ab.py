"""benchmarks.kernel_ab: the baseline's source from git, alternating calls of two builds (which is which, results
compared), bad arguments refused."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import kernel_ab
from kernels import cpu
from kernels.reference.fused import ALWAYS

ROOT = cpu.SOURCE.parents[1]
needs_git = pytest.mark.skipif(not shutil.which("git") or not (ROOT / ".git").exists(), reason="needs a git checkout")


def tiny_scan(n: int = 300) -> tuple:
    """fused_scan's arguments: n servable ads with random vectors (4 expert dims, 4 gating dims, a bias), one
    request of 2 experts, top 1 of them, m = 5."""
    gen = torch.Generator().manual_seed(3)
    status, start, end = torch.full((n,), 7, dtype=torch.int8), torch.zeros(n, dtype=torch.int64), torch.full((n,), 10**6)
    refs = torch.full((n, 2), ALWAYS, dtype=torch.int32)
    vectors = torch.randn((n, 9), generator=gen)
    experts, keys = torch.randn((1, 2, 4), generator=gen), torch.randn((1, 2, 4), generator=gen)
    return (status, start, end, refs, vectors, None, torch.tensor([5]), torch.zeros((1, 1), dtype=torch.int32),
            experts, keys, torch.ones((1, 2), dtype=torch.bool), 8, 1, 5)


class Sleeper:
    """Stands in for a build: its fused_scan takes `seconds` and reports success (writes nothing)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def fused_scan(self, *args) -> int:
        time.sleep(self.seconds)
        return 0


@needs_git
def test_the_baseline_source_comes_from_git():
    assert kernel_ab.interface(kernel_ab.source_at("HEAD")) == kernel_ab.interface(cpu.SOURCE.read_bytes()) != ""
    for bad in ("no-such-revision", "--help"):
        with pytest.raises(ValueError, match="revision"):
            kernel_ab.source_at(bad)


def test_a_kernel_with_another_interface_is_told_apart():
    source = cpu.SOURCE.read_bytes()
    older = source.replace(b'extern "C" int fused_scan(', b'extern "C" void fused_scan(')
    declared = source.index(b'extern "C" int fused_scan(')
    wider = source[:declared] + source[declared:].replace(b"int64_t* counts) {", b"int64_t* counts, int extra) {", 1)
    assert interface_differs(source, older) and interface_differs(source, wider)
    rewrapped = source[:declared] + source[declared:].replace(b"int64_t m, int64_t tasks", b"int64_t m,\n    int64_t tasks", 1)
    assert rewrapped != source and not interface_differs(source, rewrapped)


def interface_differs(a: bytes, b: bytes) -> bool:
    return kernel_ab.interface(a) != kernel_ab.interface(b)


def test_the_ratio_is_the_second_build_over_the_first():
    result = kernel_ab.alternate(tiny_scan(), {"slow": Sleeper(0.02), "fast": Sleeper(0.005)}, calls=4)
    assert result["ms"]["slow"] > result["ms"]["fast"] and result["ratio"] < 1


SCORE = b"finish(r, g.first + b, xs.data() + k * stride, sims.data() + q * LANES) + biases[k]"  # the kernel's score of an ad


def build_with_score(score: bytes) -> ctypes.CDLL:
    """A build of the working tree's kernel that scores an ad by `score` instead of SCORE."""
    source = cpu.SOURCE.read_bytes()
    assert SCORE in source
    return ctypes.CDLL(str(cpu.build(source.replace(SCORE, score))))


def test_builds_of_one_source_agree_and_a_changed_result_is_flagged():
    """A build that subtracts the ad's bias instead of adding it gives another top: flagged, and still timed."""
    same = kernel_ab.alternate(tiny_scan(), {"a": cpu.library(), "b": cpu.library()}, calls=1)
    assert same["same"] and same["rounding"] and same["score_gap"] == 0
    wrong = build_with_score(SCORE.replace(b"+ biases", b"- biases"))
    result = kernel_ab.alternate(tiny_scan(), {"right": cpu.library(), "wrong": wrong}, calls=1)
    assert not result["same"] and not result["rounding"] and result["score_gap"] > 0 and result["ratio"] > 0


@pytest.mark.parametrize("score, rounding", [(SCORE.replace(b"biases[k]", b"biases[k] * (1.0f + 0x1p-20f)"), True),
                                             (b"(" + SCORE + b") - 1.0f", False)])
def test_rounding_is_told_apart_from_scores_that_moved_in_the_same_order(score, rounding):
    """The bias times 1 + 2^-20 moves scores by a rounding step; every score less 1 keeps every slot (and
    the heap's bar only lower) but is another result."""
    changed = build_with_score(score)
    assert torch.equal(cpu.fused_scan(*tiny_scan())[0], cpu.fused_scan(*tiny_scan(), lib=changed)[0])
    result = kernel_ab.alternate(tiny_scan(), {"right": cpu.library(), "changed": changed}, calls=1)
    assert not result["same"] and result["rounding"] == rounding and result["score_gap"] > 0


@needs_git
@pytest.mark.parametrize("argv, field", [(["--base", "no-such-revision"], "--base"), (["--calls", "0"], "--calls"),
                                         (["--batch", "1", "-2"], "--batch")])
def test_bad_arguments_are_parser_errors(argv, field):
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ab", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and field in run.stderr
