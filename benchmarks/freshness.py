"""Update throughput and freshness under load, through a real redis-server (AOF, fsync always): a
publisher process writes ad edits to the per-shard streams while a replica's consumer applies them and a
query thread retrieves concurrently.

- Apply rate: a backlog of edits waits in the stream; the time the consumer takes to apply all of it
  (once with no queries, once while queries are served).
- With --shards S the publisher splits the edits over S shard streams and the replica serves shard 0.
- Freshness: edits published at a fixed rate; latency = the time the consumer made an entry servable (its
  batch applied under the table's write lock, so the next query sees it) minus the entry's publish
  timestamp (taken just before XADD). Writes its table to docs/benchmarks.md.

    python -m benchmarks.freshness --rates 2000 5000 10000 --seconds 15
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import redis
import torch
from tqdm import tqdm

from andromeda_cli.args import NON_NEGATIVE, POSITIVE, non_negative_float, positive_float
from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops, read_events
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.sharding import shard_of
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request
from benchmarks.common import command_line, machine, write_section
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis
from index_updater.publisher import Publisher


def load_corpus(world: Path, schema, scorer) -> list:
    """The world's ads as prepared upserts (version 1)."""
    return [op for batch in read_events(world / "events.jsonl") for op in prepare_ops(schema, scorer, batch)
            if hasattr(op, "ad") and op.ad.version == 1]


def edits(corpus: list, version: int) -> list:
    """The same ads again with a new version and bid (a stream of advertiser edits)."""
    return [type(op)(op.ad.model_copy(update={"version": version, "bid": op.ad.bid + 0.01}), op.targeting, op.embedding)
            for op in corpus]


TICK = 0.01  # seconds between the rate-limited publisher's transactions


def publisher_process(world: Path, url: str, shards: int, commands, done) -> None:
    """A separate publisher service. Commands: ("seed",) the corpus; ("backlog", n) n edits at once;
    ("rate", events_per_s, seconds) edits, one batch every TICK; None stops. Answers each with (seconds
    taken, how many of the events belong to shard 0)."""
    torch.set_num_threads(1)
    schema, scorer = load_schema(), HashedTwoTower()
    corpus = load_corpus(world, schema, scorer)
    publisher = Publisher(redis.Redis.from_url(url), schema, scorer, shards=shards)
    version = 1

    def planned(n: int) -> list:
        nonlocal version
        out: list = []
        while len(out) < n:
            version += 1
            out += edits(corpus, version)
        return out[:n]

    def send(ops: list, per_batch: int, tick: float | None) -> tuple[float, int]:
        started = next_tick = time.perf_counter()
        for i in range(0, len(ops), per_batch):
            publisher.publish_ops(ops[i:i + per_batch])
            if tick:
                next_tick += tick
                time.sleep(max(0.0, next_tick - time.perf_counter()))
        return time.perf_counter() - started, sum(shard_of(op.ad.ad_id, shards) == 0 for op in ops)

    done.put(len(corpus))
    for kind, *args in iter(commands.get, None):
        if kind == "seed":
            done.put(send(corpus, 1000, None))
        elif kind == "backlog":
            done.put(send(planned(args[0]), 1000, None))
        else:
            rate, seconds = args
            done.put(send(planned(int(rate * seconds)), max(1, int(rate * TICK)), TICK))


class QueryLoad:
    """A thread sending one retrieval every 1/qps seconds (open loop), however long each takes."""

    def __init__(self, retriever: Retriever, request, qps: float):
        self.retriever, self.request, self.qps, self.count = retriever, request, qps, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            self.retriever.retrieve([self.request])
            self.count += 1
            next_at += 1 / self.qps
            time.sleep(max(0.0, next_at - time.perf_counter()))

    def __enter__(self) -> "QueryLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def apply_rate(consumer: ShardConsumer, commands, done, backlog: int, load: QueryLoad | None) -> dict:
    """Events/s the consumer applies from a backlog of `backlog` edits (queries served meanwhile if `load`)."""
    commands.put(("backlog", backlog))
    done.get()  # all of it is in the stream before the clock starts
    before, started = consumer.stats.applied, time.perf_counter()
    queries = load.count if load else 0
    consumer.catch_up()
    seconds = time.perf_counter() - started
    return {"events": consumer.stats.applied - before, "rate": (consumer.stats.applied - before) / seconds,
            "qps": ((load.count - queries) / seconds) if load else 0.0}


def freshness(consumer: ShardConsumer, commands, done, rate: int, seconds: float, load: QueryLoad) -> dict:
    """XADD -> servable latency of edits published at `rate` events/s for `seconds`, queries served meanwhile."""
    consumer.stats.apply_latency_ms = deque()  # every event's: the consumer keeps the newest 100,000 only
    before, queries, started = consumer.stats.applied, load.count, time.perf_counter()
    commands.put(("rate", rate, seconds))
    publish_seconds, mine = done.get()
    published = time.perf_counter()
    deadline = time.monotonic() + 60
    while consumer.stats.applied - before < mine and time.monotonic() < deadline:
        time.sleep(0.01)
    window = publish_seconds + time.perf_counter() - published  # publishing, then draining what was left
    latencies = np.array(consumer.stats.apply_latency_ms)
    return {"rate": rate, "publish_rate": int(rate * seconds) / publish_seconds,
            "applied_rate": (consumer.stats.applied - before) / window,
            "p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99)),
            "max": float(latencies.max()), "qps": (load.count - queries) / (time.perf_counter() - started)}


def run(args, world: Path, url: str) -> tuple[list[dict], list[dict], int]:
    """(apply-rate rows, freshness rows, ads in the index) for one replica of shard 0 of args.shards."""
    schema, scorer = load_schema(), HashedTwoTower()
    client = redis.Redis.from_url(url)
    ctx = mp.get_context("spawn")
    commands, done = ctx.Queue(), ctx.Queue()
    publisher = ctx.Process(target=publisher_process, args=(world, url, args.shards, commands, done))
    publisher.start()
    phases = tqdm(total=3 + len(args.rates), desc="seed the stream and index", unit="phase")

    def next_phase(name: str) -> None:
        phases.update()
        phases.set_description(name)

    try:
        index = AdIndex(schema, scorer.dim, capacity=2 * done.get())
        consumer = ShardConsumer(client, index, scorer.name, shard=0, shards=args.shards, block_ms=5)
        commands.put(("seed",))
        done.get()
        consumer.catch_up()
        ads = len(index)  # the background consumer's sweeps later free the ads whose end_time has passed
        retriever = Retriever(index, scorer)
        request = parse_request((world / "requests.jsonl").read_text().splitlines()[0])
        next_phase("apply rate, no queries")
        rates = [apply_rate(consumer, commands, done, args.backlog, None)]
        next_phase("apply rate, queries meanwhile")
        with QueryLoad(retriever, request, args.qps) as load:
            rates.append(apply_rate(consumer, commands, done, args.backlog, load))
            consumer.start()
            try:
                rows = []
                for rate in args.rates:
                    next_phase(f"freshness at {rate:,} events/s")
                    rows.append(freshness(consumer, commands, done, rate, args.seconds, load))
            finally:
                consumer.stop()
        phases.update()
        return rates, rows, ads
    finally:
        phases.close()
        commands.put(None)
        publisher.join()


def report(args, command: str, rates: list[dict], rows: list[dict], ads: int, load_before: float) -> str:
    idle, busy = rates
    table = ["| target events/s | published events/s | applied events/s | p50 ms | p99 ms | max ms | queries/s meanwhile |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['rate']:,} | {r['publish_rate']:,.0f} | {r['applied_rate']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
              f"{r['max']:.1f} | {r['qps']:.1f} |" for r in rows]
    return f"""## Update apply rate and freshness (XADD -> servable) under concurrent retrieval

`{command}`

Machine: {machine()}. On this machine at once: one redis-server (AOF, appendfsync always); a publisher
process writing ad edits to the per-shard streams; the replica process with its consumer of shard 0 of
{args.shards} (XREAD of its shard's stream, each read decoded at once and applied as one atomic batch) and a
query thread sending {args.qps:g} retrievals/s (open loop) over its index of {ads:,} ads (the fused
pass, 1 thread). The 1-minute load average before the run was {load_before:.1f} (above 0, other processes
were using the cores too).

Apply rate, a backlog of {args.backlog:,} edits published (those of shard 0 wait in its stream):
{idle['rate']:,.0f} events/s applied with no queries; {busy['rate']:,.0f} events/s while serving {busy['qps']:.1f} queries/s.

Freshness: edits published at a fixed rate (all shards together), one transaction per shard stream every
10 ms; "applied" counts shard 0's events. Latency per entry
= servable time (its batch applied under the table's write lock, so the next query sees it) - publish
timestamp (taken just before XADD).

{chr(10).join(table)}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=POSITIVE, nargs="+", default=[2000, 5000, 10000])
    p.add_argument("--seconds", type=positive_float, default=15.0)
    p.add_argument("--ads", type=POSITIVE, default=50000)
    p.add_argument("--backlog", type=NON_NEGATIVE, default=100000, help="edits waiting in the stream for the apply-rate runs")
    p.add_argument("--shards", type=POSITIVE, default=1, help="the publisher splits edits over this many shard streams")
    p.add_argument("--qps", type=non_negative_float, default=20.0, help="retrieval requests per second meanwhile (open loop)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # the query thread shares the 2 cores with publisher, consumer and redis
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        world = synthesize(WorldConfig(ads=args.ads, users=4, seed=21), Path(tmp) / "world", load_schema())
        server = LocalRedis(Path(tmp) / "redis", aof=True).start()
        try:
            rates, rows, ads = run(args, world, server.url)
        finally:
            server.stop()
    body = report(args, command_line("benchmarks.freshness", p, args), rates, rows, ads, load_before)
    print(body)
    if not args.no_write:
        write_section("freshness", body)


if __name__ == "__main__":
    main()
