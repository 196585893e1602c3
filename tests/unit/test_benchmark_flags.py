"""The benchmarks refuse sizes they cannot run with argparse's one-line error (exit 2), before any work: until
2026-12-07 they gave tracebacks, and `freshness --shards 0` hung once its publisher process had died. The command
line a section of docs/ records names every value its run had (until 2026-12-07 some flags went unrecorded)."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from andromeda_cli.args import POSITIVE, non_negative_float, positive_float
from benchmarks.common import command_line
from benchmarks.load import rate_list


@pytest.mark.parametrize("argv, words", [
    (["benchmarks.freshness", "--shards", "0"], "argument --shards: must be an integer >= 1, got '0'"),
    (["benchmarks.load", "--rates", "10,0"], "argument --rates: must be a finite number > 0, got '0'"),
    (["benchmarks.kernels", "--tile", "0"], "argument --tile: must be an integer >= 1, got '0'"),
])
def test_a_benchmark_refuses_a_size_it_cannot_run(argv, words):
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


def _parser() -> argparse.ArgumentParser:
    """Options of every shape the benchmarks declare."""
    p = argparse.ArgumentParser()
    p.add_argument("--tile", type=POSITIVE, nargs="+", default=[1, 10])
    p.add_argument("--rates", type=rate_list, default="10,15")
    p.add_argument("--seconds", type=positive_float, default=15.0)
    p.add_argument("--peer-pairs", type=non_negative_float, default=16e6)
    p.add_argument("--storage", nargs="+", default=["fp16", "int8"], choices=["fp16", "int8"])
    p.add_argument("--table", type=Path, default=None)
    p.add_argument("--no-write", action="store_true")
    return p


@pytest.mark.parametrize("argv", [[], ["--tile", "3", "--seconds", "2.5", "--peer-pairs", "0"],
                                  ["--rates", "1,2.5", "--storage", "int8", "--table", "a dir/t.pt", "--no-write"]])
def test_the_recorded_command_line_runs_with_every_value_of_its_run(argv):
    p = _parser()
    args = p.parse_args(argv)
    line = command_line("benchmarks.x", p, args)
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "benchmarks.x"] and p.parse_args(words[3:]) == args, line
    assert "--seconds" in words and "--storage" in words  # defaults too: they may change after the run
    assert ("--table" in words) == (args.table is not None) and ("--no-write" in words) == args.no_write
