"""The CPU kernel of the working tree against itself at a git revision, the two builds called alternately in
one process over the same table and requests. On a shared machine the time of separate runs swings by tens of
percent; calls that alternate share its state, so the median of their ratios resolves a few percent. Both
builds must give the same top: the same slots, and scores that differ at most by rounding (another order of
additions, or fused multiply-adds: within ROUNDING of the largest score); a pair that does not is flagged.

Only kernels/cpu_fused.cpp comes from the revision: the compiler flags and the Python wrapper (kernels/cpu.py)
are the working tree's, so the revision's kernel must have today's interface (its `fused_scan` declaration);
one that does not is refused.

    python -m benchmarks.kernel_ab --table .devcheck/table-1m.pt --base HEAD --batch 1 16
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import re
import statistics
import subprocess
from pathlib import Path

import torch

from andromeda_cli.args import POSITIVE
from benchmarks.common import timed_in_turn
from benchmarks.kernels import TOP_N, K, S, table_and_requests
from kernels import cpu

WORKING_TREE = "working tree"
ROUNDING = 1e-5  # relative to the largest score: float32 rounding of a ~100-term dot product stays far below it


def source_at(revision: str) -> bytes:
    """kernels/cpu_fused.cpp as committed at `revision`; ValueError naming it when git cannot show it."""
    if revision.startswith("-"):
        raise ValueError(f"{revision!r} is not a revision")
    try:
        run = subprocess.run(["git", "show", f"{revision}:kernels/cpu_fused.cpp"], cwd=cpu.SOURCE.parents[1],
                             capture_output=True)
    except FileNotFoundError:
        raise ValueError("git is not installed: the baseline is read from the repository's history") from None
    if run.returncode:
        raise ValueError(f"git cannot show kernels/cpu_fused.cpp at {revision!r}: {run.stderr.decode().strip()[:300]}")
    return run.stdout


def interface(source: bytes) -> str:
    """The kernel's `extern "C" int fused_scan(...)` declaration, whitespace collapsed ('' when it has none)."""
    found = re.search(rb'extern "C" int fused_scan\([^)]*\)', source)
    return b" ".join(found.group().split()).decode() if found else ""


def alternate(args: tuple, builds: dict[str, ctypes.CDLL], calls: int) -> dict:
    """cpu.fused_scan(*args) with each of two builds, `calls` rounds (in turn, the first build first in even
    rounds, second in odd ones) -> {"same": both gave the same result, "rounding": the same slots and counts, the
    scores within rounding (ROUNDING), "score_gap": the largest difference of their scores, "ms": {build: median
    ms}, "ratio": median over rounds of the second build's time over the first's}."""
    (first, first_lib), (second, second_lib) = builds.items()
    (slots_a, scores_a, counts_a), (slots_b, scores_b, counts_b) = (cpu.fused_scan(*args, lib=lib)
                                                                    for lib in (first_lib, second_lib))
    same_slots = torch.equal(slots_a, slots_b) and torch.equal(counts_a, counts_b)
    gap = (scores_a.double() - scores_b.double()).nan_to_num(0.0).abs().max().item() if scores_a.numel() else 0.0
    largest = scores_a.double().nan_to_num(0.0, 0.0, 0.0).abs().max().item() if scores_a.numel() else 0.0
    times = timed_in_turn({name: functools.partial(cpu.fused_scan, *args, lib=lib) for name, lib in builds.items()},
                          calls)
    return {"same": same_slots and torch.equal(scores_a, scores_b),
            "rounding": same_slots and gap <= ROUNDING * max(largest, 1.0), "score_gap": gap,
            "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(b / a for a, b in zip(times[first], times[second]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the git revision whose kernels/cpu_fused.cpp is the baseline")
    p.add_argument("--table", type=Path, default=None, help="a table saved by `benchmarks.kernels --save-table`")
    p.add_argument("--ads", type=POSITIVE, default=1_000_000, help="without --table: ads of the synthetic world to build")
    p.add_argument("--batch", type=POSITIVE, nargs="+", default=[1, 16])
    p.add_argument("--storage", nargs="+", default=["fp16"], choices=["fp16", "int8"])
    p.add_argument("--calls", type=POSITIVE, default=20, help="alternating rounds per (storage, batch)")
    p.add_argument("--threads", type=POSITIVE, default=2)
    args = p.parse_args()
    try:
        base = source_at(args.base)
    except ValueError as exc:
        p.error(f"--base: {exc}")
    if interface(base) != interface(cpu.SOURCE.read_bytes()):
        p.error(f"--base: the kernel at {args.base} declares another fused_scan than the working tree's wrapper calls")
    world, requests = table_and_requests(p, args.table, args.ads, args.batch)
    torch.set_num_threads(args.threads)
    builds = {args.base: ctypes.CDLL(str(cpu.build(base))), WORKING_TREE: cpu.library()}
    gen = torch.Generator().manual_seed(0)
    for storage in args.storage:
        t = world.stored(storage).tiled(1, "cpu")  # rows aligned as an AdIndex aligns them
        for B in args.batch:
            scan = (t.status, t.start, t.end, t.refs, t.vectors, t.scales, *requests.batch(B, gen), S - 1, TOP_N, K)
            r = alternate(scan, builds, args.calls)
            print(f"{storage} B={B}: {args.base} {r['ms'][args.base]:.2f} ms, {WORKING_TREE} {r['ms'][WORKING_TREE]:.2f} ms; "
                  f"{WORKING_TREE} / {args.base} = {r['ratio']:.3f} (median of {args.calls} alternating rounds)"
                  + ("" if r["same"] else f"; the same slots, scores within {r['score_gap']:.2g} (rounding)"
                     if r["rounding"] else f"; RESULTS DIFFER (scores by up to {r['score_gap']:.3g}, or slots)"))


if __name__ == "__main__":
    main()
