"""benchmarks.cpu_anatomy: each variant of the table changes only what it says (where the rows lie, or whether any
ad is servable), and its report names every variant's time."""
from __future__ import annotations

import argparse

import torch

from andromeda_core.quantization import aligned_rows, quantize_int8
from benchmarks import cpu_anatomy
from benchmarks.kernels import Table
from kernels import cpu
from kernels.reference.fused import ALWAYS

N, WIDTH = 301, 9  # 4 expert dims, 4 gating dims, a bias


def tiny_table(storage: str) -> tuple[Table, tuple]:
    """n servable ads with random rows (laid out as an AdIndex lays them out), and one request's inputs."""
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn((N, WIDTH), generator=gen)
    vectors, scales = quantize_int8(raw) if storage == "int8" else (raw.half(), None)
    rows = aligned_rows(N, WIDTH, vectors.dtype)
    rows.copy_(vectors)
    table = Table(torch.full((N,), 7, dtype=torch.int8), torch.zeros(N, dtype=torch.int64),
                  torch.full((N,), 10**6), torch.full((N, 2), ALWAYS, dtype=torch.int32), rows, scales)
    request = (torch.tensor([5]), torch.zeros((1, 1), dtype=torch.int32), torch.randn((1, 2, 4), generator=gen),
               torch.randn((1, 2, 4), generator=gen), torch.ones((1, 2), dtype=torch.bool))
    return table, request


def scan(t: Table, request: tuple):
    return cpu.fused_scan(t.status, t.start, t.end, t.refs, t.vectors, t.scales, *request, WIDTH - 1, 1, 7)


def test_each_variant_changes_only_what_it_says():
    for storage in ("fp16", "int8"):
        table, request = tiny_table(storage)
        tables = cpu_anatomy.variants(table)
        assert list(tables) == list(cpu_anatomy.VARIANTS)
        slots, scores, counts = scan(tables["as served"], request)
        assert int(counts[0]) == N
        apart = tables["rows 8x apart"]
        assert torch.equal(apart.vectors, table.vectors)  # the same values ...
        assert apart.vectors.stride(0) == cpu_anatomy.SPREAD * table.vectors.stride(0)  # ... further apart
        if storage == "int8":  # the scales too, in a tensor the kernel reads as it is (no contiguous copy)
            assert apart.scales.is_contiguous() and apart.scales.shape[1] == cpu_anatomy.SPREAD * table.scales.shape[1]
            assert torch.equal(apart.scales[:, :table.scales.shape[1]], table.scales)
        assert all(torch.equal(a, b) for a, b in zip(scan(apart, request), (slots, scores, counts)))
        assert int(scan(tables["match only"], request)[2][0]) == 0
        cached = tables["rows in cache"].vectors
        assert cached.untyped_storage().nbytes() == (N + WIDTH) * cached.element_size()  # a buffer of n + w
        assert torch.equal(cached[1, :-1], cached[0, 1:]) and not torch.equal(cached[1], cached[0])
        assert int(scan(tables["rows in cache"], request)[2][0]) == N


def test_the_report_names_every_variant_and_the_floor():
    ms = {name: 10.0 + i for i, name in enumerate(cpu_anatomy.VARIANTS)}
    rows = [dict(n=N, storage="fp16", B=1, ms=ms, pairs=2e6, floor=cpu_anatomy.fma_floor_ms(2e6, 320.0))]
    args = argparse.Namespace(batch=[1], storage=["fp16"], rounds=3)
    text = cpu_anatomy.report(rows, args, "python -m benchmarks.cpu_anatomy --rounds 3", read_bw=27.0, peak=320.0)
    assert "| 301 | fp16 | 1 | 10.0 | 11.0 | 12.0 | 13.0 | 1.0 | -2.0 | 2.00M | 6.4 |" in text
    assert "--rounds 3" in text and "27.0 GB/s" in text
