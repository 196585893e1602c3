"""The benchmarks refuse sizes they cannot run with argparse's one-line error (exit 2), before any work: until
2026-12-07 they gave tracebacks, and `freshness --shards 0` hung once its publisher process had died."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, words", [
    (["benchmarks.freshness", "--shards", "0"], "argument --shards: must be an integer >= 1, got '0'"),
    (["benchmarks.load", "--rates", "10,0"], "argument --rates: must be a finite number > 0, got '0'"),
    (["benchmarks.kernels", "--tile", "0"], "argument --tile: must be an integer >= 1, got '0'"),
])
def test_a_benchmark_refuses_a_size_it_cannot_run(argv, words):
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
