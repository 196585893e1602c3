"""The first request of each shape after a replica starts: how long it waits for the kernels' build or JIT,
without Retriever.warm_up and after it. Each run is a fresh process with an empty Triton cache, as a new pod
has: the second runs warm_up first (as a shard replica does) and times warm_up itself.

A synthetic world of --ads ads, hashed two-tower vectors; for each (requests, k) shape, the first call and the
median of the next few. Printed only (a GPU check reads it).

    python -m benchmarks.cold_start --device cuda            # both runs, each in its own process
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from andromeda_cli.args import POSITIVE
from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request
from benchmarks.common import sync

SHAPES = ((1, 100), (2, 100), (16, 100), (1, 10), (1, 1000), (64, 100))  # (requests, k) of a replica's first calls


def run(device: str, ads: int, warm: bool) -> None:
    schema = load_schema()
    scorer = HashedTwoTower(device=device)
    index = AdIndex(schema, scorer.dim, capacity=ads, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        world = synthesize(WorldConfig(ads=ads, users=8, seed=3), Path(tmp) / "w", schema)
        load_events(index, schema, scorer, read_events(world / "events.jsonl"))
    retriever = Retriever(index, scorer)
    if warm:
        started = time.perf_counter()
        retriever.warm_up()
        sync(device)
        print(f"warm_up: {time.perf_counter() - started:.2f} s", flush=True)
    for batch, k in SHAPES:
        requests = [parse_request({"user": {"user_id": 1, "attributes": {"country": "US"}}, "k": k})] * batch
        times = []
        for _ in range(4):
            started = time.perf_counter()
            retriever.retrieve(requests)
            sync(device)
            times.append(time.perf_counter() - started)
        print(f"{'after warm_up' if warm else 'cold'}: B = {batch:>2}, k = {k:>4}: first {1e3 * times[0]:8.1f} ms, "
              f"then {1e3 * statistics.median(times[1:]):6.1f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ads", type=POSITIVE, default=20000)
    p.add_argument("--one", choices=["cold", "warm"], help="run only this one, in this process")
    args = p.parse_args()
    if args.one:
        run(args.device, args.ads, args.one == "warm")
        return
    for one in ("cold", "warm"):
        with tempfile.TemporaryDirectory() as cache:  # Triton's compiled kernels: none, as in a new pod
            subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--device", args.device, "--ads",
                            str(args.ads), "--one", one], env={**os.environ, "TRITON_CACHE_DIR": cache}, check=True)


if __name__ == "__main__":
    main()
