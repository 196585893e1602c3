"""Serving under load: the real service (Ray Serve router + shard replicas, fed through a private
redis-server) over HTTP, driven by an open-loop generator, beside (a) the same retriever called
in-process and (b) FAISS IndexFlatIP behind a plain FastAPI endpoint with targeting post-filtering.
Also the bytes per request between router and shards. Writes docs/load.png and its section of
docs/benchmarks.md.

    python -m benchmarks.load --ads 20000 --rates 10,15,20,30,40,60,80,120,160,240,320 --seconds 15 --shards 1
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
import redis
import torch

from andromeda_cli.args import POSITIVE, int_in, positive_float
from andromeda_core.index import AdIndex
from andromeda_core.models.serving import load_scorer
from andromeda_core.ingest import load_events, read_events
from andromeda_core.retriever import Retriever, UserQuery, compile_requests
from andromeda_core.schema import load_schema
from andromeda_core.sharding import shard_of
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import RetrieveRequest, parse_request
from benchmarks import load_cpu
from benchmarks.common import DOCS, command_line, machine, write_section
from benchmarks.load_client import bodies, run_step
from deployments.config import APP_NAME, ServiceConfig, apply_serve_env
from deployments.shard import HistoryVectors, ShardAnswer
from index_updater.local_redis import LocalRedis, free_port
from index_updater.publisher import Publisher

K = 100
SEED = 0
CHECK = 100  # requests whose HTTP answers are compared with the in-process ones
TIMEOUT_S = 10.0  # per HTTP request; a request still unanswered then is an error
WARMUP_S = 3.0  # an unreported step at the first rate: connections, caches, lazy imports
PLOT = DOCS.parent / "load.png"
RAY_SERVE_DEFAULTS = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                      "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(4 << 20)}  # Ray 2.60's, for SERVE_ENV's names


def post(url: str, body: bytes) -> tuple[dict, int]:
    """One JSON POST -> (parsed reply, reply size in bytes)."""
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
        raw = reply.read()
    return json.loads(raw), len(raw)


def wait_http(url: str, timeout_s: float = 600) -> None:
    """Poll GET url until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


# -- in-process baseline and bytes on the wire ----------------------------------------------------

def in_process(retriever: Retriever, requests: list[RetrieveRequest], seconds: float) -> tuple[dict, list[list[int]]]:
    """Our exact answers to the first CHECK requests, then one request at a time for `seconds`:
    latency percentiles (ms) and the rate that gives (max QPS of one caller)."""
    answers = [[a.ad_id for a in retriever.retrieve([r])[0].ads] for r in requests[:CHECK]]
    latencies, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        retriever.retrieve([requests[len(latencies) % len(requests)]])
        latencies.append((time.perf_counter() - t) * 1000)
    ms = np.array(latencies)
    stats = {"requests": len(ms), "qps": len(ms) / (time.perf_counter() - started), "mean": float(ms.mean()),
             **{q: float(np.percentile(ms, int(q[1:]))) for q in ("p50", "p95", "p99")}}
    return stats, answers


def wire_bytes(retriever: Retriever, requests: list[RetrieveRequest], shards: int) -> dict:
    """Pickled bytes per request between router and shards, built the way deployments/router.py
    builds them, against shipping every eligible candidate (8-byte id + 4-byte score) instead."""
    index, scorer = retriever.index, retriever.scorer
    rows = []
    for r in requests:
        compiled = compile_requests(index.schema, [r])[0]
        users = scorer.encode_users([r], index.embeddings_of, [compiled.now])
        query = UserQuery(users, [compiled.values], [compiled.now], [r.k])
        topk = retriever.search(query)
        answer = ShardAnswer(topk, "1764460899123-0", 1.0, index.high_water)
        history = sorted({h.ad_id for h in r.user.history} | {c.ad_id for c in r.user.co_engagement})
        by_shard: dict[int, list[int]] = {}
        for ad_id in history:
            by_shard.setdefault(shard_of(ad_id, shards), []).append(ad_id)
        rows.append({"query": len(pickle.dumps(query)), "answer": len(pickle.dumps(answer)),
                     "eligible": int(topk.eligible[0]), "history_ads": len(history),
                     "history_out": sum(len(pickle.dumps(ids)) for ids in by_shard.values()),
                     "history_back": sum(len(pickle.dumps(HistoryVectors(*index.embeddings_of(ids))))
                                        for ids in by_shard.values())})
    mean = {key: float(np.mean([row[key] for row in rows])) for key in rows[0]}
    eligible = np.array([row["eligible"] for row in rows])
    return {**mean, "shards": shards, "dim": scorer.dim, "eligible_p50": float(np.percentile(eligible, 50)),
            "eligible_p99": float(np.percentile(eligible, 99)), "requests": len(rows)}


# -- the two HTTP systems ----------------------------------------------------------------------------

@contextmanager
def faiss_peer(world: Path) -> Iterator[str]:
    """benchmarks.load_faiss in its own process on a free loopback port; yields its base URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.load_faiss", "--events", str(world / "events.jsonl"),
                                "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", 300)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def service(config: ServiceConfig, world: Path) -> Iterator[str]:
    """Publish the corpus to the config's Redis, run the app on a local Ray (2 CPUs), wait for /readyz."""
    import ray
    from ray import serve

    from deployments.app import build_app

    schema = load_schema(config.schema_path)
    Publisher(redis.Redis.from_url(config.redis_url), schema, load_scorer(config.model, schema), shards=config.shards,
              stream=config.stream).publish_file(world / "events.jsonl")
    apply_serve_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://{config.host}:{config.port}"
        wait_http(f"{url}/readyz")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def knee(row: dict, first: dict) -> str | None:
    """Why this step is past the knee, or None."""
    if row["errors"] > 0.01 * row["sent"]:
        return f"errors {row['errors'] / row['sent']:.1%} > 1%"
    if row["achieved"] < 0.9 * row["offered"]:
        return f"achieved {row['achieved']:.0f}/s < 90% of offered"
    if row["p99"] > 10 * first["p99"]:
        return f"p99 {row['p99']:.0f} ms > 10x the first step's {first['p99']:.1f} ms"
    return None


def step_up(name: str, url: str, world: Path, rates: list[float], seconds: float, pool: ProcessPoolExecutor) -> list[dict]:
    """After a warm-up, open-loop steps of rising rate until the knee (the generator runs in `pool`'s process)."""

    def step(rate: float, length: float) -> dict:
        return pool.submit(run_step, f"{url}/v1/retrieve", str(world / "requests.jsonl"), K, rate, length,
                           TIMEOUT_S).result()

    step(rates[0], WARMUP_S)
    rows: list[dict] = []
    for rate in rates:
        before, started = load_cpu.snapshot(), time.perf_counter()
        row = step(rate, seconds)
        row |= load_cpu.costs(load_cpu.used(before, load_cpu.snapshot()), row["sent"] - row["errors"],
                              time.perf_counter() - started)
        row["knee"] = knee(row, rows[0] if rows else row)
        rows.append(row)
        print(f"{name:>8} offered {rate:6.0f}/s achieved {row['achieved']:7.1f}/s p50 {row['p50']:8.1f} ms "
              f"p95 {row['p95']:8.1f} ms p99 {row['p99']:8.1f} ms errors {row['errors']}/{row['sent']} "
              f"(generator late p99 {row['late_p99']:.1f} ms) server CPU {row['server_cpu_ms']:.1f} ms/request, "
              f"others {row['others_cores']:.2f} cores{'  KNEE: ' + row['knee'] if row['knee'] else ''}",
              flush=True)
        if row["knee"]:
            break
    return rows


def check(url: str, payloads: tuple[bytes, ...], want: list[list[int]]) -> dict:
    """Sequential answers to the first CHECK requests vs ours: same ids in the same order, recall of
    our top-k, mean round trip (ms), response bytes, candidates searched (FAISS peer)."""
    same = found = total = size = 0
    candidates, took = [], []
    for body, ours in zip(payloads, want):
        started = time.perf_counter()
        reply, n = post(f"{url}/v1/retrieve", body)
        took.append((time.perf_counter() - started) * 1000)
        got = [a["ad_id"] for a in reply["ads"]]
        same += got == ours
        found += len(set(got) & set(ours))
        total, size = total + len(ours), size + n
        candidates.append(reply.get("candidates", 0))
    return {"same": same, "checked": len(want), "recall": found / max(total, 1), "response_bytes": size / len(want),
            "candidates": float(np.mean(candidates)), "round_trip": float(np.mean(took))}


def stage_means(url: str) -> dict[str, float]:
    """Mean ms per router stage of POST /v1/retrieve, and of the shards' own passes ("shard pass"), over
    the requests answered so far (the service's GET /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT_S) as reply:
        text = reply.read().decode()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "andromeda_request_seconds" and sample.labels.get("endpoint") == "retrieve":
                stage = sample.labels["stage"]
            elif family.name == "andromeda_shard_search_seconds":
                stage = "shard pass"
            else:
                continue
            if sample.name.endswith(("_sum", "_count")):
                sums.setdefault(stage, [0.0, 0.0])[sample.name.endswith("_count")] += sample.value
    return {stage: 1000 * total / count for stage, (total, count) in sums.items() if count}


# -- report ------------------------------------------------------------------------------------------

def plot(systems: dict[str, list[dict]], reference: dict, path: Path) -> None:
    """Latency (p50, p99) against offered load per system; the in-process latencies and rate as references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, rows), color in zip(systems.items(), ("C0", "C1")):
        x = [r["offered"] for r in rows]
        ax.plot(x, [r["p99"] for r in rows], "-o", color=color, label=f"{name}: p99")
        ax.plot(x, [r["p50"] for r in rows], "--o", color=color, label=f"{name}: p50")
    for q, style in (("p99", "-"), ("p50", "--")):
        ax.axhline(reference[q], color="gray", linestyle=style, label=f"in-process, one at a time: {q}")
    ax.axvline(reference["qps"], color="gray", linestyle=":", label="in-process, one at a time: max rate")
    rates = sorted({r["offered"] for rows in systems.values() for r in rows})
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{r:g}" for r in rates], minor=False)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(yscale="log", xlabel="offered load (requests/s, open loop)", ylabel="latency (ms)",
           title="POST /v1/retrieve latency vs offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def step_table(rows: list[dict]) -> str:
    lines = ["| offered req/s | sent | achieved req/s | p50 ms | p95 ms | p99 ms | errors | generator late p99 ms "
             "| server CPU ms per answered request | other processes' CPU, cores | knee |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['offered']:g} | {r['sent']} | {r['achieved']:.1f} | {r['p50']:.1f} | {r['p95']:.1f} | {r['p99']:.1f} "
              f"| {r['errors']} | {r['late_p99']:.1f} | {r['server_cpu_ms']:.1f} | {r['others_cores']:.2f} "
              f"| {r['knee'] or ''} |" for r in rows]
    return "\n".join(lines)


def knee_line(rows: list[dict]) -> str:
    good = [r["offered"] for r in rows if not r["knee"]]
    last = f"highest step within the limits: {good[-1]:g} req/s" if good else "no step within the limits"
    broke = f"knee at {rows[-1]['offered']:g} req/s ({rows[-1]['knee']})" if rows[-1]["knee"] else "no knee up to the last rate"
    return f"{last}; {broke}."


def cpu_line(row: dict) -> str:
    """CPU per answered request by process role at one step."""
    roles = ", ".join(f"{r} {ms:.1f} ms" for r, ms in sorted(row["cpu_ms"].items(), key=lambda kv: -kv[1]) if ms >= 0.05)
    return f"CPU per answered request at {row['offered']:g} req/s, by process: {roles}."


def stage_line(c: dict, inproc: dict) -> str:
    """Where a sequential request's time goes in the service (router stages from its /metrics)."""
    st = c["stages"]
    inside = " + ".join(f"{name} {st.get(stage, float('nan')):.1f}" for name, stage in
                        (("compile", "compile"), ("history lookup", "history"), ("user towers", "user_towers"),
                         ("shards", "shards"), ("merge", "merge")))
    return (f"Where the time goes with no load (means over those {c['checked']} sequential requests): HTTP round "
            f"trip {c['round_trip']:.1f} ms; in the router {st.get('total', float('nan')):.1f} ms = {inside} ms "
            f"(a shard's own batched pass: {st.get('shard pass', float('nan')):.1f} ms); the remaining "
            f"{c['round_trip'] - st.get('total', float('nan')):.1f} ms are HTTP, the Serve proxy and the client. "
            f"In-process the whole request takes {inproc['mean']:.1f} ms (mean).")


def wire_table(w: dict, request_bytes: float, response_bytes: float) -> str:
    s, hist = w["shards"], w["history_out"] + w["history_back"]
    topk = s * (w["query"] + w["answer"])
    return "\n".join([
        "| per request (mean over the world's requests) | bytes |", "|---|---|",
        f"| client -> router: request JSON (k = {K}) | {request_bytes:,.0f} |",
        f"| router -> client: response JSON | {response_bytes:,.0f} |",
        f"| router -> each shard: UserQuery (user vector, targeting values, now, k), pickled | {w['query']:,.0f} |",
        f"| each shard -> router: ShardAnswer (top-{K} ids + scores, eligible, watermark), pickled | {w['answer']:,.0f} |",
        f"| **top-k scatter/gather, {s} shard(s): {s} x (query + answer)** | **{topk:,.0f}** |",
        f"| instead, shards ship every eligible candidate: 12 B (id + score) x {w['eligible']:,.0f} eligible "
        f"(p50 {w['eligible_p50']:,.0f}, p99 {w['eligible_p99']:,.0f}) | {12 * w['eligible']:,.0f} |",
        f"| history-vector lookup: ids out + ({w['history_ads']:.1f} ads x {w['dim']} float32, found) back, pickled "
        f"| {w['history_out']:,.0f} + {w['history_back']:,.0f} = {hist:,.0f} |",
    ])


def report(args, command: str, ads: int, inproc: dict, systems: dict, checks: dict, wire: dict,
           request_bytes: float) -> str:
    parts = [f"""## Serving under load

`{command}`

Machine: {machine()}. Everything ran on it at once: the system under test, the load generator (its
own process: asyncio + aiohttp, open loop: request i is sent at t0 + i/rate whatever the earlier ones
are doing, latency measured from that due time, so queueing anywhere, the generator's included, counts)
and for the service a redis-server. Corpus: a synthetic world (seed {SEED}, {args.ads:,} ads, {ads:,} live after the
stream's deletes, {args.users:,} users), model: {args.model or 'the untrained hashed two-tower'}; requests
cycle through the world's {args.users:,} real requests (attributes, history, context), k = {K}. Steps of
{args.seconds:g} s at rising fixed rates until the knee (p99 > 10x the first step's p99, or errors > 1%,
or achieved < 90% of offered); achieved = successful replies / time from the first due time to the last
reply; latencies are of the successful replies; a request unanswered after {TIMEOUT_S:g} s is an error.
Server CPU = CPU time (from /proc) of every process this benchmark started except the load generator
(for the service: Serve proxy, router, shards, Ray's own processes, redis-server), per answered
request; other processes' CPU = the machine's busy time minus ours during the step, in cores (the two
counters are read separately: +-0.05): work by other users of the machine, competing for the same cores.

- **In-process**: `Retriever.retrieve` on an AdIndex built from the same events, one request at a time
  in the benchmark process, 1 torch thread (what a shard replica gets: 0.5 CPU, OMP_NUM_THREADS=1).
  {inproc['requests']} requests: p50 {inproc['p50']:.1f} ms, p95 {inproc['p95']:.1f} ms, p99 {inproc['p99']:.1f} ms,
  {inproc['qps']:.1f} requests/s.
""" + "".join(f"- **{name}**: {knee_line(rows)}\n" for name, rows in systems.items())]
    for name, rows in systems.items():
        c = checks[name]
        text = (f"{DESCRIBE[name].format(shards=args.shards)} Answers to the first {c['checked']} requests (sequential) "
                f"vs in-process: {c['same']} identical (ids and order), recall of our top-{K} {c['recall']:.1%}. "
                f"{CANDIDATES.format(**c) if name == FAISS else stage_line(c, inproc)} {cpu_line(rows[0])}")
        parts.append(f"### {name}\n\n{textwrap.fill(text, 110)}\n\n{step_table(rows)}\n")
    text = (f"Measured on the same corpus: objects built as deployments/router.py and shard.py build them, pickled "
            f"(Ray adds its own framing on top); the top-{K} answer has a fixed shape whatever the shard holds.")
    parts.append(f"### Bytes per request between router and shards\n\n{textwrap.fill(text, 110)}\n\n"
                 f"{wire_table(wire, request_bytes, checks.get(SERVICE, {}).get('response_bytes', float('nan')))}\n")
    parts.append("![latency vs offered load](load.png)\n")
    return "\n".join(parts)


SERVICE, FAISS = "service over HTTP", "FAISS + FastAPI"
CANDIDATES = ("Sequential HTTP round trip {round_trip:.1f} ms (mean). FAISS candidates searched per request "
              "(final k', mean): {candidates:,.0f}.")
DESCRIBE = {
    SERVICE: "The real service: Ray Serve (local Ray, 2 CPUs) HTTP proxy -> router (FastAPI ingress, user tower, "
             "history lookup) -> {shards} shard deployment(s) of 1 replica (0.5 CPU each; @serve.batch pass over "
             "the shard's table) -> exact merge; index fed from a private redis-server (AOF, fsync always).",
    FAISS: "What a user would build instead: uvicorn (one process, sync FastAPI endpoint) over FAISS IndexFlatIP "
           "of the same ad vectors (1 thread), the same user tower with history vectors from a dict, top k' "
           "(k' = k, x4 until k eligible are found or the whole corpus is searched) post-filtered by the project's "
           "exact targeting match on those slots.",
}


def rate_list(text: str) -> str:
    """--rates: comma-separated offered rates, each a number > 0 (kept as written, for the recorded command)."""
    for rate in text.split(","):
        positive_float(rate)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ads", type=POSITIVE, default=20000)
    p.add_argument("--users", type=POSITIVE, default=500)
    p.add_argument("--rates", type=rate_list, default="10,15,20,30,40,60,80,120,160,240,320",
                   help="offered requests/s per step, comma separated")
    p.add_argument("--seconds", type=positive_float, default=15.0, help="length of each step")
    p.add_argument("--shards", type=int_in(1, 1024), default=1)
    p.add_argument("--model", type=Path, default=None, help="trained checkpoint (the FAISS peer is then skipped)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    p.add_argument("--no-faiss", action="store_true", help="the service only (implies --no-write)")
    p.add_argument("--ray-defaults", action="store_true",
                   help="the service on Ray Serve's defaults instead of SERVE_ENV, for A/B runs (implies --no-write)")
    args = p.parse_args()
    args.no_write |= args.no_faiss or args.ray_defaults
    if args.ray_defaults:  # apply_serve_env keeps a value already set
        os.environ.update(RAY_SERVE_DEFAULTS)
    rates = [float(r) for r in args.rates.split(",")]
    torch.set_num_threads(1)
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        world = synthesize(WorldConfig(ads=args.ads, users=args.users, seed=SEED), tmp / "world")
        server = LocalRedis(tmp / "redis").start()
        try:
            config = ServiceConfig(redis_url=server.url, shards=args.shards, model=str(args.model) if args.model else None,
                                   device="cpu", snapshot_dir=str(tmp / "snapshots"), port=free_port())
            schema = load_schema(config.schema_path)
            scorer = load_scorer(config.model, schema)
            index = AdIndex(schema, scorer.dim)
            load_events(index, schema, scorer, read_events(world / "events.jsonl"))
            retriever = Retriever(index, scorer)
            payloads = bodies(str(world / "requests.jsonl"), K)
            requests = [parse_request(body) for body in payloads]
            inproc, ours = in_process(retriever, requests, args.seconds)
            print(f"in-process: p50 {inproc['p50']:.1f} ms p99 {inproc['p99']:.1f} ms, {inproc['qps']:.1f} requests/s")
            wire = wire_bytes(retriever, requests, args.shards)
            print("bytes per request:", json.dumps(wire))
            systems, checks = {}, {}
            if args.model is None and not args.no_faiss:
                with faiss_peer(world) as url:
                    checks[FAISS] = check(url, payloads, ours)
                    systems[FAISS] = step_up("faiss", url, world, rates, args.seconds, pool)
            with service(config, world) as url:
                checks[SERVICE] = {**check(url, payloads, ours), "stages": stage_means(url)}
                systems[SERVICE] = step_up("service", url, world, rates, args.seconds, pool)
        finally:
            server.stop()
            pool.shutdown()
    systems = {name: systems[name] for name in (SERVICE, FAISS) if name in systems}
    body = report(args, command_line("benchmarks.load", p, args), len(index), inproc, systems, checks, wire,
                  float(np.mean([len(b) for b in payloads])))
    print(body)
    if not args.no_write:
        plot(systems, inproc, PLOT)
        write_section("load", body)


if __name__ == "__main__":
    main()
