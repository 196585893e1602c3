"""How long a replica stops applying updates while it snapshots its table (CPU).

A CPU table of a synthetic world's ads (HashedTwoTower vectors of the MoE's stored width, 113 float32) applies
a batch of edits at a fixed interval, as a consumer under a steady stream does; meanwhile a snapshot round of
`ShardConsumer` runs in the applying thread: with background_snapshots (the default: a thread of its own copies
the table while it applies, the rows written meanwhile are copied again between two applies, and the thread writes
the copy) and without (written from views of the live table between two applies).
The pause is the longest time between two applies around the round. Writes its table to docs/benchmarks.md.

    python -m benchmarks.snapshot_pause --ads 1000000
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import redis
import torch
from tqdm import tqdm

from andromeda_core.index import AdIndex
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_cli.args import POSITIVE, non_negative_float
from benchmarks.common import command_line, machine, write_section
from benchmarks.freshness import edits, load_corpus
from index_updater.consumer import ShardConsumer
from index_updater.snapshots import SnapshotStore

STORED_DIMS = 113  # the MoE's stored vector (models.towers.Dims.stored): what a served table holds per ad


def pauses(index: AdIndex, batches: list[list], consumer: ShardConsumer, interval: float, seconds: float) -> dict:
    """Apply batches every `interval` s for `seconds`, a snapshot round a third of the way in and the loop's
    finish_background_write before each apply: the longest gap between two applies, the time spent in the round
    and in those calls from then on, the median gap and the snapshot file's size."""
    gaps, started, last, round_s, i, taken = [], time.perf_counter(), time.perf_counter(), 0.0, 0, False
    while time.perf_counter() - started < seconds or not taken:
        at = time.perf_counter()
        if not taken and at - started >= seconds / 3:
            consumer._snapshot_round(claim=False)
            taken = True
        consumer.finish_background_write()  # as each turn of the loop: finishes the copy once its bulk is copied
        round_s += time.perf_counter() - at if taken else 0.0
        index.apply(batches[i % len(batches)])
        i += 1
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(max(0.0, interval - (time.perf_counter() - now)))
    while consumer._writer is not None:
        consumer.finish_background_write()
        time.sleep(interval)
    gaps.sort()
    return {"longest": gaps[-1], "median": gaps[len(gaps) // 2], "round": round_s,
            "bytes": max(p.stat().st_size for p in consumer.snapshots.paths())}


def report(args, command: str, ads: int, rows: list[tuple[str, dict]]) -> str:
    lines = ["| snapshots | snapshot work in the applying thread, s | longest pause between applies, s | median gap, ms | "
             "snapshot size |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['round']:.2f} | {r['longest']:.2f} | {r['median'] * 1000:.0f} | "
              f"{r['bytes'] / 1e6:,.0f} MB |" for name, r in rows]
    return f"""## Update pause while a replica snapshots its table

`{command}`

Machine: {machine()}. A CPU table of {ads:,} ads (a synthetic world's, {STORED_DIMS} float32 per vector, what the
MoE's table holds) applies {args.batch} edits every {args.interval * 1000:.0f} ms in one thread (edits of
{100 * args.batch:,} ads spread evenly over the table, in turn), as a consumer does under a steady stream; a third of the way into {args.seconds:g} s, a snapshot round of `ShardConsumer` runs
in that thread. "background": the default, a thread of its own copies the table while it applies (the rows
written meanwhile copied again between two applies) and writes the copy;
"in the applying thread": `background_snapshots=False`, written from views of the live table before the next
apply. Each row one run, in the order run.

{chr(10).join(lines)}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ads", type=POSITIVE, default=1_000_000)
    p.add_argument("--batch", type=POSITIVE, default=50, help="edits per apply")
    p.add_argument("--interval", type=non_negative_float, default=0.02, help="seconds between applies")
    p.add_argument("--seconds", type=non_negative_float, default=12.0,
                   help="length of each run (at least until its snapshot is taken)")
    p.add_argument("--repeats", type=POSITIVE, default=2, help="runs of each way")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # what a shard replica gets
    schema, scorer = load_schema(), HashedTwoTower(dim=STORED_DIMS)
    with tempfile.TemporaryDirectory() as tmp:
        world = synthesize(WorldConfig(ads=args.ads, users=4, seed=21), Path(tmp) / "world", schema)
        corpus = load_corpus(world, schema, scorer)
        index = AdIndex(schema, scorer.dim, capacity=len(corpus))
        for first in tqdm(range(0, len(corpus), 10_000), desc="index"):
            index.apply(corpus[first:first + 10_000])
        edited = 100 * args.batch  # ads, spread evenly over the table: the rows written during a copy are scattered
        changed = edits(corpus[:: max(1, len(corpus) // edited)][:edited], 2)
        batches = [changed[k:k + args.batch] for k in range(0, len(changed), args.batch)]
        rows = []
        for _ in range(args.repeats):
            for name, background in (("in the applying thread", False), ("background", True)):
                store = SnapshotStore(Path(tempfile.mkdtemp(dir=tmp)))
                consumer = ShardConsumer(redis.Redis(), index, scorer.name, snapshots=store,  # no Redis call made
                                         background_snapshots=background)
                rows.append((name, pauses(index, batches, consumer, args.interval, args.seconds)))
                print(name, rows[-1], flush=True)
    body = report(args, command_line("benchmarks.snapshot_pause", p, args), len(index), rows)
    print(body)
    if not args.no_write:
        write_section("snapshot-pause", body)


if __name__ == "__main__":
    main()
