"""Update freshness under load: publish ad edits at a fixed rate through a real redis-server (AOF,
fsync always) while a replica's consumer applies them and a query thread retrieves concurrently.

Latency = time the consumer made an entry servable (its batch applied under the table lock, so the
next query sees it) minus the entry's publish timestamp (taken just before XADD). Writes its table
to docs/benchmarks.md.

    python -m benchmarks.freshness --rates 2000 5000 10000 --seconds 15
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import redis
import torch

from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops, read_events
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request
from benchmarks.common import machine, write_section
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis
from index_updater.publisher import Publisher


def edits(upserts: list, version: int) -> list:
    """The same ads again with a new version and bid (a stream of advertiser edits)."""
    return [type(op)(op.ad.model_copy(update={"version": version, "bid": op.ad.bid + 0.01}), op.targeting, op.embedding)
            for op in upserts]


def load_corpus(world: Path, schema, scorer) -> list:
    return [op for batch in read_events(world / "events.jsonl") for op in prepare_ops(schema, scorer, batch)
            if hasattr(op, "ad") and op.ad.version == 1]


def publisher_process(world: Path, url: str, rate: int, seconds: float, ready, go) -> None:
    """A separate publisher service: prepare the edits, then send a transaction every 10 ms at `rate`."""
    torch.set_num_threads(1)
    schema, scorer = load_schema(), HashedTwoTower()
    corpus = load_corpus(world, schema, scorer)
    total, tick = int(rate * seconds), 0.01
    planned = [op for v in range(2, 2 + total // len(corpus) + 1) for op in edits(corpus, v)][:total]
    publisher = Publisher(redis.Redis.from_url(url), schema, scorer)
    per_tick = max(1, int(rate * tick))
    ready.set()
    go.wait()
    sent, next_tick = 0, time.perf_counter()
    while sent < total:
        publisher.publish_ops(planned[sent:sent + per_tick])
        sent += per_tick
        next_tick += tick
        time.sleep(max(0.0, next_tick - time.perf_counter()))


def run(rate: int, seconds: float, qps: float, world: Path, corpus: list, request, server, schema, scorer) -> dict:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    index = AdIndex(schema, scorer.dim, capacity=len(corpus) * 2)
    consumer = ShardConsumer(client, index, scorer.name, block_ms=5)
    Publisher(client, schema, scorer).publish_ops(corpus)
    consumer.catch_up()
    consumer.stats.apply_latency_ms.clear()
    retriever = Retriever(index, scorer)
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    publisher = ctx.Process(target=publisher_process, args=(world, server.url, rate, seconds, ready, go))
    publisher.start()
    ready.wait()
    stop, queries = threading.Event(), [0]

    def query_loop():  # open loop: one request every 1/qps seconds, however long each takes
        next_at = time.perf_counter()
        while not stop.is_set():
            retriever.retrieve([request])
            queries[0] += 1
            next_at += 1 / qps
            time.sleep(max(0.0, next_at - time.perf_counter()))

    consumer.start()
    querier = threading.Thread(target=query_loop)
    querier.start()
    started = time.perf_counter()
    go.set()
    publisher.join()
    publish_seconds = time.perf_counter() - started
    target = len(corpus) + int(rate * seconds)
    deadline = time.monotonic() + 30
    while consumer.stats.applied + consumer.stats.stale < target and time.monotonic() < deadline:
        time.sleep(0.01)
    drained = time.perf_counter() - started
    stop.set()
    querier.join()
    consumer.stop()
    latencies = np.array(consumer.stats.apply_latency_ms)
    return {"rate": rate, "publish_rate": int(rate * seconds) / publish_seconds,
            "applied_rate": (consumer.stats.applied - len(corpus)) / drained,
            "p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99)),
            "max": float(latencies.max()), "qps": queries[0] / drained, "ads": len(index)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=int, nargs="+", default=[2000, 5000, 10000])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--ads", type=int, default=50000)
    p.add_argument("--qps", type=float, default=20.0, help="retrieval requests per second meanwhile (open loop)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # the query thread shares the 2 cores with publisher, consumer and redis
    schema, scorer = load_schema(), HashedTwoTower()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        world = synthesize(WorldConfig(ads=args.ads, users=4, seed=21), Path(tmp) / "world", schema)
        corpus = load_corpus(world, schema, scorer)
        request = parse_request((world / "requests.jsonl").read_text().splitlines()[0])
        server = LocalRedis(Path(tmp) / "redis", aof=True).start()
        try:
            for rate in args.rates:
                row = run(rate, args.seconds, args.qps, world, corpus, request, server, schema, scorer)
                rows.append(row)
                print(f"target {rate:>6}/s: published {row['publish_rate']:8.0f}/s applied {row['applied_rate']:8.0f}/s "
                      f"XADD->servable p50 {row['p50']:7.1f} ms p99 {row['p99']:7.1f} ms max {row['max']:7.1f} ms "
                      f"while serving {row['qps']:.1f} queries/s over {row['ads']} ads")
        finally:
            server.stop()
    table = ["| target events/s | published events/s | applied events/s | p50 ms | p99 ms | max ms | queries/s meanwhile |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['rate']:,} | {r['publish_rate']:,.0f} | {r['applied_rate']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
              f"{r['max']:.1f} | {r['qps']:.1f} |" for r in rows]
    body = f"""## Update freshness (XADD -> servable) under concurrent retrieval

`python -m benchmarks.freshness --rates {' '.join(map(str, args.rates))} --seconds {args.seconds:g} --ads {args.ads}`

Machine: {machine()}. On this machine at once: one redis-server (AOF, appendfsync always); a publisher
process sending one transaction of ad edits every 10 ms; the replica process with its shard consumer
(XREAD, each read applied as one atomic batch) and a query thread sending {args.qps:g} retrievals/s
(open loop) over the {args.ads:,}-ad index (reference pipeline, 1 torch thread). Latency per entry =
servable time (its batch applied under the table lock, so the next query sees it) - publish timestamp
(taken just before XADD).

{chr(10).join(table)}
"""
    print(body)
    if not args.no_write:
        write_section("freshness", body)


if __name__ == "__main__":
    main()
