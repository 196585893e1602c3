"""Where the CPU's fused pass spends its time: the same call over variants of one table, called in turn in one
process (alternating rounds, so that a shared machine's swings hit every variant alike), medians per variant.

- as served: the table as an AdIndex holds it (rows padded to whole cache lines);
- match only: no ad servable (status 0): the match still reads every ad's status, window and clause refs and
  tests them, but no row is loaded or scored;
- rows in cache: every slot's row starts one element after the last one's (rows overlap, so each differs, in a
  buffer of a few MB that stays in the caches; an int8 table's scales stay as served): the same match and scoring,
  without the trips to memory for the rows;
- rows 8x apart: each row (and an int8 table's row of scales) 8 times further from the last than served: the same
  rows read, at addresses a hardware prefetcher streaming the table would fetch 8 times the bytes for.

Derived: scoring = rows in cache - match only (the decode, the MoE head and the heaps), waiting for rows =
as served - rows in cache. The multiply-adds the similarities need (ceil(D / P) 16-lane fused multiply-adds per
eligible user-ad pair, P = 2 dims per lane for E = 6 experts, so 12 of their 16 lanes hold an expert's dims:
cpu_fused.cpp) are set against the peak the same run's fp32 matmul reaches: this kernel's floor, not any head's.

    python -m benchmarks.cpu_anatomy --table .devcheck/table-1m.pt --batch 1 16
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from andromeda_cli.args import POSITIVE
from benchmarks.common import command_line, machine, matmul_gflops, write_section
from benchmarks.kernels import D, E, K, S, TOP_N, Table, read_gbs, table_and_requests
from kernels import cpu

VARIANTS = ("as served", "match only", "rows in cache", "rows 8x apart")
SPREAD = 8


def overlapping(rows: torch.Tensor) -> torch.Tensor:
    """(n, w) -> (n, w) whose row i is elements i .. i + w - 1 of one buffer of n + w: every row differs, all fit
    in the caches."""
    n, width = rows.shape
    return rows.contiguous().view(-1)[: n + width].clone().as_strided((n, width), (1, 1))


def spread(rows: torch.Tensor, times: int) -> torch.Tensor:
    """(n, w) rows of stride s -> (n, times * s), each row's w values first: the same rows, times * s apart. A
    contiguous tensor, as the kernels read an int8 table's scales (n_scales = its width); vectors are read at their
    row stride, so a view of its first w columns serves for them."""
    n, width = rows.shape
    wide = torch.zeros((n, rows.stride(0) * times), dtype=rows.dtype)
    wide[:, :width] = rows
    return wide


def variants(table: Table) -> dict[str, Table]:
    """The table as served and as each variant of VARIANTS (the module's docstring)."""
    t = table
    return {"as served": t,
            "match only": Table(torch.zeros_like(t.status), t.start, t.end, t.refs, t.vectors, t.scales),
            "rows in cache": Table(t.status, t.start, t.end, t.refs, overlapping(t.vectors), t.scales),
            "rows 8x apart": Table(t.status, t.start, t.end, t.refs, spread(t.vectors, SPREAD)[:, :t.vectors.shape[1]],
                                   None if t.scales is None else spread(t.scales, SPREAD))}


def scan(t: Table, req: tuple):
    """The CPU pass over table t for the requests req: (slots, scores, eligible counts)."""
    return cpu.fused_scan(t.status, t.start, t.end, t.refs, t.vectors, t.scales, *req, S - 1, TOP_N, K)


def alternate(tables: dict[str, Table], req: tuple, rounds: int) -> dict[str, float]:
    """Median ms per call of each table's pass over the requests, `rounds` rounds of one call each in turn (each
    round starting at the next variant, so none always follows the same one)."""
    times, names = {name: [] for name in tables}, list(tables)
    for t in tables.values():
        scan(t, req)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            started = time.perf_counter()
            scan(tables[name], req)
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(ms) for name, ms in times.items()}


def fma_floor_ms(pairs: float, peak_gflops: float) -> float:
    """Milliseconds the 16-lane fp32 multiply-adds this kernel issues for the similarities of `pairs` eligible pairs
    take at the peak rate."""
    per_pair = -(-D // cpu.packing(E))
    return pairs * per_pair / (peak_gflops * 1e9 / 32) * 1000


def report(rows: list[dict], args, command: str, read_bw: float, peak: float) -> str:
    lines = [
        "## Where the CPU pass spends its time",
        "",
        f"`{command}` (over the saved 1M-ad table of `benchmarks.kernels`)",
        "",
        f"Machine: {machine()}; read bandwidth {read_bw:.1f} GB/s, fp32 matmul {peak:.0f} GFLOP/s, both measured in "
        "the same run. The variants (the module's docstring): \"match only\" makes no ad servable; \"rows in "
        "cache\" lays the rows over each other in a few MB that stay in the caches; \"rows 8x apart\" puts 8 times "
        "the bytes between the rows a pass reads. Scoring = rows in cache - match only; waiting for rows = as "
        "served - rows in cache (for int8 the scales are still read from memory there). \"FMA floor\": the 16-lane "
        "multiply-adds this kernel issues for the similarities of the eligible pairs (12 of the 16 lanes in use) at "
        f"the matmul's rate (32 FLOPs each): the least this kernel's design can take here. Medians of {args.rounds} "
        "alternating rounds.",
        "",
        "| ads | storage | B | as served ms | match only ms | rows in cache ms | rows 8x apart ms | scoring ms | "
        "waiting for rows ms | eligible pairs | FMA floor ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['n']:,} | {r['storage']} | {r['B']} | {ms['as served']:.1f} | {ms['match only']:.1f} | "
            f"{ms['rows in cache']:.1f} | {ms['rows 8x apart']:.1f} | {ms['rows in cache'] - ms['match only']:.1f} | "
            f"{ms['as served'] - ms['rows in cache']:.1f} | {r['pairs'] / 1e6:.2f}M | {r['floor']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", type=Path, default=None, help="a table saved by `benchmarks.kernels --save-table`")
    p.add_argument("--ads", type=POSITIVE, default=1_000_000, help="without --table: ads of the synthetic world to build")
    p.add_argument("--batch", type=POSITIVE, nargs="+", default=[1, 16])
    p.add_argument("--storage", nargs="+", default=["fp16", "int8"], choices=["fp16", "int8"])
    p.add_argument("--rounds", type=POSITIVE, default=15)
    p.add_argument("--threads", type=POSITIVE, default=2)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    read_bw, peak = read_gbs("cpu"), matmul_gflops("cpu")
    print(f"machine: {machine()}; read bandwidth {read_bw:.1f} GB/s, fp32 matmul {peak:.0f} GFLOP/s")
    world, requests = table_and_requests(p, args.table, args.ads, args.batch)
    rows = []
    for storage in args.storage:
        tables = variants(world.stored(storage).tiled(1, "cpu"))  # rows aligned as an AdIndex aligns them
        for B in args.batch:
            req = requests.batch(B, torch.Generator().manual_seed(B))
            pairs = float(scan(tables["as served"], req)[2].sum())
            row = dict(n=len(world.status), storage=storage, B=B, ms=alternate(tables, req, args.rounds),
                       pairs=pairs, floor=fma_floor_ms(pairs, peak))
            rows.append(row)
            print(f"{storage} B={B}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
                  + f"; {pairs / 1e6:.2f}M eligible pairs, FMA floor {row['floor']:.2f} ms")
        tables = None
    if not args.no_write:
        command = command_line("benchmarks.cpu_anatomy", p, args)
        write_section("kernels-cpu-anatomy", report(rows, args, command, read_bw, peak))


if __name__ == "__main__":
    main()
