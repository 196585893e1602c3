"""Shared benchmark helpers: machine description, hardware ceilings, timing, docs/ sections."""
from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


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


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Achieved memory read bandwidth (GB/s) of a torch sum over a large fp32 buffer."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    seconds = median_seconds(lambda: buf.sum(), repeats)
    return buf.numel() * 4 / seconds / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Achieved fp32 matmul rate (GFLOP/s): the practical peak FLOP rate of this machine."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats) / 1e9


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
    DOCS.write_text(text)
