"""Shared benchmark helpers: machine description, hardware ceilings, timing, docs/ sections."""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def command_line(module: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """`python -m module` with every option's value as parsed, defaults included (a flag only when set, an unset
    optional path left out), so that the line a section records reproduces its run after a default changes."""
    words = ["python", "-m", module]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "help" or value is None or value is False:
            continue
        words.append(action.option_strings[-1])
        if action.nargs == 0:
            continue
        values = value if isinstance(value, list) else [value]
        words += [str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in values]
    return shlex.join(words)


def vector_isa(flags: set[str]) -> str:
    """The widest vector instructions the CPU kernels use that a CPU with these /proc/cpuinfo flags has."""
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2 + FMA, no AVX-512" if {"avx2", "fma"} <= flags else "no AVX2: portable loops"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.*)", info).group(1)
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
        cpu += f" ({vector_isa(flags)})"
    except (OSError, AttributeError):
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores available, {torch.get_num_threads()} torch threads{gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_in_turn(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each callable's seconds in each of `rounds` rounds, after one call each: in a round they are called in turn, in
    the given order in even rounds and in reverse in odd ones. On a shared machine separate runs swing by tens of
    percent; calls in turn share its state, so the ratio of two in the same round resolves a few percent."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds):
        for name in list(fns) if round_ % 2 == 0 else list(fns)[::-1]:
            started = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - started)
    return times


def sync(device: str) -> None:
    """Waits for the device's queued work (a no-op on the CPU), so that a timing covers it."""
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_gflops(device: str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Achieved rate (GFLOP/s) of one large square matmul in dtype on device: the practical peak FLOP rate the
    benchmarks measure their share of (n = 2048 on the CPU, 8192 on a GPU, large enough to reach it)."""
    n = 2048 if device == "cpu" else 8192
    a, b = torch.randn((n, n), device=device, dtype=dtype), torch.randn((n, n), device=device, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: (a @ b, sync(device)), repeats) / 1e9


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section between <!-- name:start --> and <!-- name:end --> in docs/benchmarks.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOCS.parent.mkdir(exist_ok=True)
    partial = DOCS.with_suffix(".md.partial")  # replaced in one step: a run killed while writing leaves the old file
    partial.write_text(text)
    os.replace(partial, DOCS)
