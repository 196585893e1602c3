"""benchmarks.kernel_ab: the baseline's source from git, alternating calls of two builds, bad revisions refused."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from benchmarks import kernel_ab
from kernels import cpu
from kernels.reference.fused import ALWAYS


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


def test_the_baseline_source_comes_from_git():
    assert b"extern \"C\" int fused_scan(" in kernel_ab.source_at("HEAD")
    with pytest.raises(ValueError, match="no-such-revision"):
        kernel_ab.source_at("no-such-revision")


def test_alternating_builds_of_one_source_agree():
    lib = ctypes.CDLL(str(cpu.build(cpu.SOURCE.read_bytes())))
    result = kernel_ab.alternate(tiny_scan(), {"a": lib, "b": cpu.library()}, calls=3)
    assert result["same"] and set(result["ms"]) == {"a", "b"}
    assert all(ms > 0 for ms in result["ms"].values()) and result["ratio"] > 0


def test_a_changed_result_is_flagged():
    """A build that subtracts the ad's bias instead of adding it gives another top: flagged, and still timed."""
    score = b"gated(r, g.first + b, xs.data() + k * stride, bar) + biases[k]"
    source = cpu.SOURCE.read_bytes()
    assert score in source
    wrong = ctypes.CDLL(str(cpu.build(source.replace(score, score.replace(b"+ biases", b"- biases")))))
    result = kernel_ab.alternate(tiny_scan(), {"right": cpu.library(), "wrong": wrong}, calls=1)
    assert not result["same"] and result["ratio"] > 0


def test_an_unknown_base_is_a_parser_error():
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ab", "--base", "no-such-revision"],
                         cwd=cpu.SOURCE.parents[1], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--base" in run.stderr and "no-such-revision" in run.stderr
