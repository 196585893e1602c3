"""Where one call of the fused pass spends its time, on one device: the wall time per call, the host's share of
it (the Triton path's request side: request_operands + upload), the device's busy time (the sum of its kernels and
copies, from torch.profiler) and the rest (launches, syncs, Python), then the profiler's top operations by host
time and by device time. For the fixed cost per call the H200 showed (about 2 ms whatever the table's size).

    python -m benchmarks.profile_pass --device cuda --table .devcheck/table-1m.pt --tile 1 10 --batch 1 64
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import machine, median_seconds, sync
from benchmarks.kernels import K, S, TOP_N, table_and_requests
from kernels import dispatch


def request_side(args_: tuple, device: str):
    """The Triton path's host work for these inputs (the request operands, uploaded), or None off CUDA."""
    if device != "cuda":
        return None
    from kernels.triton.fused import request_side as operands

    experts, keys, mask = args_[8:11]
    return lambda: operands(experts, keys, mask, args_[4].dtype, torch.device(device))


def device_ms(events, calls: int) -> float:
    """Milliseconds per call the device was busy: its kernels and copies (0 on the CPU)."""
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return busy / 1000 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ads", type=int, default=1_000_000, help="ads in the synthetic world (without --table)")
    p.add_argument("--table", type=Path, default=None, help="a table saved by benchmarks.kernels --save-table")
    p.add_argument("--tile", type=int, nargs="+", default=[1])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--storage", default="fp16", choices=["fp16", "int8"])
    p.add_argument("--calls", type=int, default=10, help="calls timed, then as many profiled")
    p.add_argument("--rows", type=int, default=12, help="operations listed per table")
    args = p.parse_args()
    dev = args.device
    print(f"machine: {machine()}; kernels: {dispatch.implementation(dev)}")
    world, requests = table_and_requests(p, args.table, args.ads, args.batch)
    stored = world.stored(args.storage)
    gen = torch.Generator().manual_seed(0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    for times in args.tile:
        on = stored.tiled(times, dev)
        for B in args.batch:
            req = tuple(t.to(dev) for t in requests.batch(B, gen))
            args_ = (on.status, on.start, on.end, on.refs, on.vectors, on.scales, *req, S - 1, TOP_N)
            wall = median_seconds(lambda: (dispatch.fused_scan(*args_, K), sync(dev)), args.calls, warmup=3)
            host = request_side(args_, dev)
            host_ms = median_seconds(lambda: (host(), sync(dev)), args.calls) * 1000 if host else 0.0
            with profile(activities=activities) as prof:
                for _ in range(args.calls):
                    dispatch.fused_scan(*args_, K)
                    sync(dev)
            events = prof.key_averages()
            busy = device_ms(events, args.calls)
            print(f"\n{len(on.status):,} ads, {args.storage}, B = {B}: {wall * 1000:.3f} ms per call = request side "
                  f"{host_ms:.3f} + device busy {busy:.3f} + the rest {wall * 1000 - host_ms - busy:.3f} ms")
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
            if dev == "cuda":
                print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=48))
        on = None  # frees the device copy before the next size


if __name__ == "__main__":
    main()
