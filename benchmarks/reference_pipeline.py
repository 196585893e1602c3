"""CPU benchmark of the reference pipeline (match, score, top-k) beside FAISS IndexFlatIP.

Builds a real index from a synthetic world (events -> parse -> compile -> ad tower -> index) and
times one pass over it for one request (and a small batch), stage by stage, against FAISS's plain
dot-product scan of the same embeddings with the same number of threads. Writes its table to
docs/benchmarks.md.

    python -m benchmarks.reference_pipeline --ads 1000000 10000000
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch
from tqdm import tqdm

from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.targeting import compile_user
from andromeda_core.types import parse_request
from benchmarks.common import machine, matmul_gflops, median_seconds, read_bandwidth_gbs, write_section
from kernels.reference.topk import merge_topk

K = 100


def build(ads: int, workdir: Path):
    schema, scorer = load_schema(), HashedTwoTower()
    world = synthesize(WorldConfig(ads=ads, users=64, seed=11), workdir / f"world-{ads}", schema)
    index = AdIndex(schema, scorer.dim, capacity=ads + ads // 8)
    events = world / "events.jsonl"
    with tqdm(total=events.stat().st_size, unit="B", unit_scale=True, desc="index", miniters=1 << 22) as bar:
        load_events(index, schema, scorer, read_events(events, batch_size=50000, on_bytes=bar.update))
    requests = [parse_request(line) for line in (world / "requests.jsonl").read_text().splitlines()]
    (world / "events.jsonl").unlink()  # large; the index now holds it
    return Retriever(index, scorer), requests


def stage_times(retriever: Retriever, requests, repeats: int) -> dict[str, float]:
    index, scorer = retriever.index, retriever.scorer
    schema, chunk = index.schema, retriever.chunk_size
    users = [compile_user(schema, r.user.attributes, r.context.targeting_values())[0] for r in requests]
    now = [r.context.ts for r in requests]
    inputs = index.request_inputs(users, now)
    user_state = scorer.encode_users(requests, index.embeddings_of, now)
    spans = [(s, min(s + chunk, index.high_water)) for s in range(0, index.high_water, chunk)]
    ids = index.columns["ad_id"]
    oks = [index.match(*inputs, a, b) for a, b in spans]
    scores = [scorer.score(user_state, index.embeddings(a, b)) for a, b in spans]
    B = len(requests)

    def topk_only():
        best_ids = torch.empty((B, 0), dtype=torch.int64)
        best = torch.empty((B, 0))
        for (a, b), ok, sc in zip(spans, oks, scores):
            best_ids, best = merge_topk(best_ids, best, ids[a:b].expand(B, -1), sc, ok, K)

    return {
        "match": median_seconds(lambda: [index.match(*inputs, a, b) for a, b in spans], repeats),
        "score": median_seconds(lambda: [scorer.score(user_state, index.embeddings(a, b)) for a, b in spans], repeats),
        "topk": median_seconds(topk_only, repeats),
        "total": median_seconds(lambda: retriever.retrieve(requests), repeats),
    }


def faiss_seconds(retriever: Retriever, requests, repeats: int) -> float:
    emb = retriever.index.columns["embedding"][: retriever.index.high_water].numpy()
    flat = faiss.IndexFlatIP(emb.shape[1])
    flat.add(emb)
    queries = retriever.scorer.encode_users(requests, retriever.index.embeddings_of).numpy().astype(np.float32)
    seconds = median_seconds(lambda: flat.search(queries, K), repeats)
    del flat
    return seconds


def bytes_per_ad(index: AdIndex) -> int:
    """Bytes per slot the scan reads: every column but the exact copy that only rescoring gathers."""
    return sum(col[0].numel() * col.element_size() for name, col in index.columns.items() if name != "embedding_exact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ads", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    bandwidth, gflops = read_bandwidth_gbs(), matmul_gflops()
    print(f"machine: {machine()}\nmeasured read bandwidth {bandwidth:.1f} GB/s, fp32 matmul {gflops:.0f} GFLOP/s")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in args.ads:
            started = time.perf_counter()
            retriever, requests = build(n, Path(tmp))
            print(f"built {len(retriever.index)} live ads in {time.perf_counter() - started:.0f}s")
            per_ad = bytes_per_ad(retriever.index)
            slots = retriever.index.high_water
            for B in args.batch:
                batch = requests[:B]
                t = stage_times(retriever, batch, args.repeats)
                f = faiss_seconds(retriever, batch, args.repeats)
                row = dict(ads=slots, B=B, **t, faiss=f, per_ad=per_ad,
                           gbs=slots * per_ad / t["total"] / 1e9,
                           gflops=2 * retriever.scorer.dim * slots * B / t["total"] / 1e9)
                rows.append(row)
                print(f"{slots:>10} ads B={B:<3} match {t['match']*1e3:8.1f} ms  score {t['score']*1e3:8.1f} ms  "
                      f"top-k {t['topk']*1e3:8.1f} ms  total {t['total']*1e3:8.1f} ms  "
                      f"({slots * B / t['total'] / 1e6:6.1f}M ad-pairs/s)  FAISS {f*1e3:8.1f} ms  "
                      f"FAISS/ours {f / t['total']:.2f}x")
            del retriever
    table = ["| ads | batch | match ms | score ms | top-k ms | total ms | ours M pairs/s | FAISS ms | FAISS M pairs/s "
             "| speed vs FAISS | share of read bandwidth | share of fp32 peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pairs = r["ads"] * r["B"]
        table.append(f"| {r['ads']:,} | {r['B']} | {r['match']*1e3:.1f} | {r['score']*1e3:.1f} | {r['topk']*1e3:.1f} | "
                     f"{r['total']*1e3:.1f} | {pairs / r['total'] / 1e6:.1f} | {r['faiss']*1e3:.1f} | "
                     f"{pairs / r['faiss'] / 1e6:.1f} | {r['faiss'] / r['total']:.2f}x | "
                     f"{r['gbs'] / bandwidth:.1%} | {r['gflops'] / gflops:.2%} |")
    body = f"""## Reference pipeline on CPU vs FAISS IndexFlatIP ({', '.join(f'{n:,}' for n in args.ads)} ads)

`python -m benchmarks.reference_pipeline --ads {' '.join(map(str, args.ads))} --batch {' '.join(map(str, args.batch))} --threads {args.threads}`

Machine: {machine()}. Measured on it in the same run: read bandwidth {bandwidth:.1f} GB/s (torch fp32 sum over 1 GiB),
fp32 matmul {gflops:.0f} GFLOP/s. Ours = the PyTorch reference pipeline (targeting match over every
column, two-tower dot-product score, exact top-{K} with id tie-break), {per_ad if rows else 0} bytes per ad
slot, chunks of {65536} ads. FAISS = IndexFlatIP search (dot products + top-{K}, no targeting) over the
same fp32 embeddings, same thread count. "speed vs FAISS" > 1 means ours is faster. Bandwidth share =
ad-table bytes read / total time / measured bandwidth; FLOP share = 2*D*ads*batch / total time / matmul rate.

{chr(10).join(table)}
"""
    print(body)
    if not args.no_write:
        write_section(f"reference_pipeline_{'_'.join(map(str, args.ads))}", body)


if __name__ == "__main__":
    main()
