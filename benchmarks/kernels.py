"""The fused pass (match + MoE score + top-k) beside its peers, on one device, in one run.

The table is the project's synthetic world of --ads ads (events -> compile -> clause dictionary -> index),
with random ad vectors of the MoE's stored shape (S = 113: D = 64 expert dims, G = 16 gating dims, a
bias) in fp16 or int8 with block scales; requests are the world's own (their targeting values and times)
with random user experts (E = 6, top 2). --tile N repeats the table N times for larger corpora (the same
ads over again: same clauses, same eligible share, a clause dictionary no larger than the world's). Peers, each
over the same table and requests:

- reference: kernels.reference.fused, the PyTorch reference, in chunks of 65,536 slots;
- naive: a multi-kernel PyTorch pipeline per request (mask, gather eligible rows, matmul, top-2 softmax
  gating, top-k);
- FAISS IndexFlatIP over the same vectors in fp32 (no targeting), at its fastest of 1 or --threads threads and
  of its two distance paths (faiss_best), then timed in turn with ours over --rounds rounds (timed_in_turn: separate
  runs on a shared machine swing by tens of percent), its time over ours the median of the rounds' ratios; on CUDA,
  where the image has no faiss-gpu, a flat fp16 GEMM + torch.topk over the same vectors stands in, timed apart;
- torch.topk alone over one score per ad.

Reported per (storage, B): ads/s (ads scanned per second, whatever B), user-ad pairs/s, the bytes per
ad the fused pass reads (bytes_per_ad: the match columns, and the vector rows it loads counted in the cache lines
or GPU sectors they occupy), the GB/s that makes and its share of the read and the copy bandwidth measured in the
same run, the GFLOP/s of the MoE head over the eligible pairs (its analytical FLOPs per pair,
MoEHead.flops_per_pair) and their share of the peak FLOP rate measured in the same run (one large matmul: fp32 on
the CPU, where the pass computes in fp32; fp16 on a GPU, whose pass multiplies on fp16 tensor cores), and the time
with the MoE's user towers for the same B requests added (end to end on the device).

    python -m benchmarks.kernels --ads 1000000 --tile 1 10          # CPU
    python -m benchmarks.kernels --device cuda --ads 1000000 --tile 1 100
"""
from __future__ import annotations

import argparse
import contextlib
import pickle
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from andromeda_cli.args import NON_NEGATIVE, POSITIVE, non_negative_float
from andromeda_core.index import AdIndex
from andromeda_core.models.heads import MoEHead
from andromeda_core.models.retrieval import CO_ITEMS, RetrievalModel
from andromeda_core.models.segments import SEGMENTS
from andromeda_core.models.towers import Dims, UserInputs
from andromeda_core.ingest import load_events, read_events
from andromeda_core.quantization import aligned_rows, quantize_int8
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.targeting import compile_user
from andromeda_core.types import parse_request
from benchmarks.common import command_line, machine, matmul_gflops, median_seconds, sync, timed_in_turn, write_section
from kernels import dispatch
from kernels.reference import fused as reference

K = 100
DIMS, TOP_N = Dims(), 2  # the MoE's default sizes, as served
D, G, E = DIMS.dim, DIMS.gate, DIMS.experts
S = DIMS.stored  # the MoE's stored vector: experts' dims, gating dims, semantic dims, bias
FLOPS_PER_PAIR = MoEHead(DIMS, TOP_N).flops_per_pair()  # gating logits, similarities, top-n, softmax, gated sum, bias
CHUNK = 65536
MAX_BATCH = 64
FLAT = {True: f"IndexFlatIP over the same vectors in fp32 ({S * 4} B/ad, no targeting)",
        False: f"not on this GPU image: its column is a flat fp16 GEMM + torch.topk over the same vectors "
               f"({S * 2} B/ad, no targeting)"}


class RandomVectors:
    """Stands in for the ad tower: seeded random stored vectors of the MoE's shape (the scan's cost does
    not depend on trained values)."""

    name, dim = "bench-moe-shape", S

    def encode_ads(self, ads) -> torch.Tensor:
        gen = torch.Generator().manual_seed(ads[0].ad_id if ads else 0)
        return torch.randn((len(ads), S), generator=gen) / S**0.5


@dataclass
class Table:
    status: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    refs: torch.Tensor
    vectors: torch.Tensor  # (n, S) float32 (FAISS reads these), or as stored
    scales: torch.Tensor | None = None  # int8 storage: (n, ceil(S / 16))

    def stored(self, storage: str) -> "Table":
        vectors, scales = quantize_int8(self.vectors) if storage == "int8" else (self.vectors.half(), None)
        return Table(self.status, self.start, self.end, self.refs, vectors, scales)

    def tiled(self, times: int, device: str) -> "Table":
        """The table repeated `times` times, on `device` (tiled there: the host holds one copy), its vectors' rows
        aligned as an AdIndex aligns them."""
        def tile(t):
            return None if t is None else t.to(device).repeat(times, *([1] * (t.dim() - 1)))
        n, width = self.vectors.shape
        vectors = aligned_rows(times * n, width, self.vectors.dtype, device=device)
        vectors.unflatten(0, (times, n)).copy_(self.vectors.to(device).expand(times, n, width))
        return Table(*(tile(t) for t in (self.status, self.start, self.end, self.refs)), vectors, tile(self.scales))


def build(ads: int, workdir: Path) -> tuple[Table, "Requests"]:
    """The synthetic world of `ads` ads, indexed; the requests' inputs for up to MAX_BATCH of its requests."""
    schema = load_schema()
    world = synthesize(WorldConfig(ads=ads, users=256, seed=11), workdir / f"world-{ads}", schema)
    index = AdIndex(schema, S, capacity=ads, exact_copy=False)
    events = world / "events.jsonl"
    with tqdm(total=events.stat().st_size, unit="B", unit_scale=True, desc="index", miniters=1 << 22) as bar:
        load_events(index, schema, RandomVectors(), read_events(events, batch_size=50000, on_bytes=bar.update))
    requests = [parse_request(line) for line in (world / "requests.jsonl").read_text().splitlines()][:MAX_BATCH]
    values = [compile_user(schema, r.user.attributes, r.context.targeting_values())[0] for r in requests]
    now, truth = index.request_inputs(values, [r.context.ts for r in requests])
    status, start, end, refs, vectors, _ = index.scan_columns()
    return Table(status, start, end, refs, vectors), Requests(now, truth)


@dataclass
class Requests:
    """The world's requests as the fused pass takes them: now (R,) int64, truth (R, W) int32."""

    now: torch.Tensor
    truth: torch.Tensor

    def batch(self, B: int, gen: torch.Generator):
        """(now (B,), truth (B, W), experts (B, E, D), keys (B, E, G), mask (B, E)) for the first B requests."""
        return (self.now[:B], self.truth[:B], torch.randn((B, E, D), generator=gen),
                torch.randn((B, E, G), generator=gen) / G**0.5, torch.ones((B, E), dtype=torch.bool))


def save_table(path: Path, table: Table, requests: Requests) -> None:
    """Everything but the vectors (random: load_table draws them again), so a lent GPU need not synthesize."""
    torch.save({"status": table.status, "start": table.start, "end": table.end, "refs": table.refs,
                "now": requests.now, "truth": requests.truth}, path)


def saved_table(parser: argparse.ArgumentParser, path: Path) -> tuple[Table, Requests]:
    """load_table, or the parser's error naming --table."""
    try:
        return load_table(path)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as exc:
        parser.error(f"--table: {path} is not a table saved by --save-table ({type(exc).__name__}: {exc})"[:500])


def table_and_requests(parser: argparse.ArgumentParser, table: Path | None, ads: int, batches: list[int],
                       workdir: Path | None = None) -> tuple[Table, Requests]:
    """The table saved at `table` (saved_table), else the synthetic world of `ads` ads built in a temporary folder
    (under workdir); the parser's error naming --batch when a batch is larger than the requests it holds."""
    if table:
        world, requests = saved_table(parser, table)
    else:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            world, requests = build(ads, Path(tmp))
    if max(batches) > len(requests.now):
        parser.error(f"--batch: at most {len(requests.now)} (the requests the table holds)")
    return world, requests


def load_table(path: Path) -> tuple[Table, Requests]:
    saved = torch.load(path)
    gen = torch.Generator().manual_seed(11)
    vectors = torch.randn((len(saved["status"]), S), generator=gen) / S**0.5
    return (Table(saved["status"], saved["start"], saved["end"], saved["refs"], vectors),
            Requests(saved["now"], saved["truth"]))


def reference_pass(table: Table, req, m: int):
    """The reference over CHUNK-slot chunks, partial top-m merged."""
    slots, scores, eligible = [], [], 0
    for a in range(0, len(table.status), CHUNK):
        b = min(a + CHUNK, len(table.status))
        scales = None if table.scales is None else table.scales[a:b]
        s, sc, e = reference.fused_scan(table.status[a:b], table.start[a:b], table.end[a:b], table.refs[a:b],
                                        table.vectors[a:b], scales, *req, S - 1, TOP_N, m)
        slots.append(torch.where(s >= 0, s + a, -1))
        scores.append(sc)
        eligible = eligible + e
    slots, scores = torch.cat(slots, 1), torch.cat(scores, 1)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :m]
    return slots.gather(1, order), scores.gather(1, order), eligible


def naive_pass(table: Table, req, m: int):
    """Per request: mask, gather the eligible rows, matmuls, top-2 softmax gating, top-k."""
    now, truth, experts, keys, mask = req
    out = []
    for b in range(len(now)):
        ok = reference.clause_match(table.status, table.start, table.end, table.refs, truth[b:b + 1], now[b:b + 1])[0]
        rows = ok.nonzero().flatten()
        x = reference.dequantize(table.vectors[rows], None if table.scales is None else table.scales[rows])
        logits = x[:, D:D + G] @ keys[b].T  # (n_ok, E)
        top = logits.topk(TOP_N, dim=1)
        sims = (x[:, :D] @ experts[b].T).gather(1, top.indices)
        score = (torch.softmax(top.values, 1) * sims).sum(1) + x[:, S - 1]
        best = score.topk(min(m, len(rows)))
        out.append(rows[best.indices])
    return out


def copy_gbs(device: str) -> float:
    """Bytes read + written per second copying 1 GiB into a buffer already allocated."""
    src = torch.ones(2**28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: (dst.copy_(src), sync(device)), 5)
    return 2 * src.numel() * 4 / seconds / 1e9


def read_gbs(device: str) -> float:
    """Bytes read per second summing 1 GiB of float32 (a read-only stream, as the scan is; a copy's stores also
    cost the memory a read for ownership, so its rate understates what reads alone reach)."""
    src = torch.ones(2**28, dtype=torch.float32, device=device)
    seconds = median_seconds(lambda: (src.sum(), sync(device)), 5)
    return src.numel() * 4 / seconds / 1e9


def timed(fn, device: str, repeats: int) -> float:
    return median_seconds(lambda: (fn(), sync(device)), repeats)


MATCH_BYTES = 1 + 8 + 8  # status, start, end per ad (plus 4 per clause ref), read in order: whole cache lines of them


def vector_bytes(storage: str, device: str) -> int:
    """Bytes of memory one ad's row costs the fused pass: the units of transfer (64-byte cache lines on the CPU,
    32-byte sectors on a GPU) holding the D + G dims and the bias of a row (rows start ROW_ALIGN-aligned, as an
    AdIndex lays them out), and for int8 those holding the row's scales (8 floats: one unit)."""
    unit = 32 if device == "cuda" else 64
    size = 1 if storage == "int8" else 2
    used = {byte // unit for d in [*range(D + G), S - 1] for byte in range(d * size, (d + 1) * size)}
    scales = 1 if storage == "int8" else 0
    return (len(used) + scales) * unit


def bytes_per_ad(storage: str, device: str, refs: int, read: float, threshold_scan: bool, B: int) -> float:
    """What the fused pass of B requests reads per ad: its match columns, and the rows it loads: on the CPU, and on a
    GPU for batches of up to MATCHED_ROWS_MAX_B, those of the ads some request of the batch is eligible for (`read`,
    a share); on a GPU for larger batches every row of every block (the Triton scan loads a block's rows before it
    knows which match); on a GPU the threshold scan's sample of 1 in SAMPLE_STRIDE blocks again."""
    match = MATCH_BYTES + 4 * refs
    if device != "cuda":
        return match + read * vector_bytes(storage, device)
    from kernels.triton.fused import MATCHED_ROWS_MAX_B, SAMPLE_STRIDE

    rows = read if B <= MATCHED_ROWS_MAX_B else 1.0
    return (match + rows * vector_bytes(storage, device)) * (1 + (1 / SAMPLE_STRIDE if threshold_scan else 0))


def rows_read(world: Table, requests: Requests, B: int) -> float:
    """The share of ads whose vector a pass over the first B requests reads: those some request may be served (a
    row is read once for every request of the batch that matches it)."""
    ok = dispatch.clause_match(world.status, world.start, world.end, world.refs, requests.truth[:B], requests.now[:B])
    return float(ok.any(0).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ads", type=POSITIVE, default=1_000_000, help="ads in the synthetic world")
    p.add_argument("--tile", type=POSITIVE, nargs="+", default=[1, 10], help="corpus sizes as multiples of the world")
    p.add_argument("--batch", type=POSITIVE, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--storage", nargs="+", default=["fp16", "int8"], choices=["fp16", "int8"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=POSITIVE, default=2)
    p.add_argument("--repeats", type=POSITIVE, default=3)
    p.add_argument("--rounds", type=POSITIVE, default=7, help="CPU: rounds of ours and FAISS timed in turn")
    p.add_argument("--peer-pairs", type=non_negative_float, default=16e6,
                   help="run the reference and naive peers only up to this many user-ad pairs (they are slow)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--save-table", type=Path, default=None,
                   help="after building the world, save its table and requests here (a few tens of MB per 1M ads)")
    p.add_argument("--table", type=Path, default=None,
                   help="a table saved by --save-table: skips synthesizing the world (vectors are drawn anew)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--no-skip", action="store_true",
                   help="CUDA: the threshold scan gates every block (A/B runs of its skip below tau); implies --no-write")
    p.add_argument("--matched-rows-max-b", type=NON_NEGATIVE, default=None, metavar="B",
                   help="CUDA: batches of at most B requests load only the matched vector rows (A/B runs of "
                        "MATCHED_ROWS_MAX_B; 0: never); implies --no-write")
    args = p.parse_args()
    if args.save_table is not None:  # before the world is built (minutes at 1M ads), not after
        args.save_table.parent.mkdir(parents=True, exist_ok=True)
    if args.no_skip or args.matched_rows_max_b is not None:
        from kernels.triton import fused
        args.no_write = True
        fused.SKIP_BELOW_TAU = not args.no_skip
        if args.matched_rows_max_b is not None:
            fused.MATCHED_ROWS_MAX_B = args.matched_rows_max_b
    torch.set_num_threads(args.threads)
    dev = args.device
    copy, read_bw = copy_gbs(dev), read_gbs(dev)
    peak = matmul_gflops(dev, torch.float32 if dev == "cpu" else torch.float16)
    print(f"machine: {machine()}\ncopy bandwidth {copy:.1f} GB/s (read + write), read bandwidth {read_bw:.1f} GB/s, "
          f"matmul {peak:.0f} GFLOP/s, kernels: {dispatch.implementation(dev)}")
    rows = []
    world, requests = table_and_requests(p, args.table, args.ads, args.batch, args.workdir)
    if args.save_table and not args.table:
        save_table(args.save_table, world, requests)
    stored = {storage: world.stored(storage) for storage in args.storage}
    read = {B: rows_read(world, requests, B) for B in args.batch}  # the same share whatever the tiling
    for done, times in enumerate(args.tile, 1):
        n = times * len(world.status)
        queries = {B: np.random.default_rng(B).random((B, S), dtype=np.float32) for B in args.batch}
        if dev == "cpu":  # its setting once per size and batch (its work does not depend on our storage), its time
            # in turn with ours
            flat_scan = faiss_flat(world.vectors.repeat(times, 1))
            flat = {B: faiss_best(flat_scan, queries[B], args.threads, args.repeats) for B in args.batch}
        else:
            flat_scan = torch_flat(world.vectors, times, dev)
            flat = {B: (timed(lambda: flat_scan(queries[B]), dev, args.repeats), None) for B in args.batch}
            flat_scan = None  # frees its copy of the vectors before ours is made
        scores = torch.randn((max(args.batch), n), device=dev)
        for storage in args.storage:
            on = stored[storage].tiled(times, dev)
            for B in args.batch:  # the same requests and experts in every storage
                req = tuple(t.to(dev) for t in requests.batch(B, torch.Generator().manual_seed(B)))
                args_ = (on.status, on.start, on.end, on.refs, on.vectors, on.scales, *req, S - 1, TOP_N)
                ours, faiss_time, vs_faiss = versus_flat(lambda: dispatch.fused_scan(*args_, K), flat_scan,
                                                         queries[B], flat[B], dev, args)
                match = timed(lambda: dispatch.clause_match(on.status, on.start, on.end, on.refs, req[1], req[0]),
                              dev, args.repeats)
                eligible = float(dispatch.fused_scan(*args_, K)[2].float().mean()) / n
                peers = n * B <= args.peer_pairs
                ref = timed(lambda: reference_pass(on, req, K), dev, 1) if peers else None
                naive = timed(lambda: naive_pass(on, req, K), dev, 1) if peers else None
                topk = timed(lambda: scores[:B].topk(K, dim=1), dev, args.repeats)
                tower = timed(towers(dev, B), dev, args.repeats)
                gated, threshold_scan = gated_share(args_) if dev == "cuda" else (None, False)
                per_ad = bytes_per_ad(storage, dev, on.refs.shape[1], read[B], threshold_scan, B)
                row = dict(n=n, storage=storage, B=B, ours=ours, match=match, eligible=eligible, read=read[B], per_ad=per_ad, ref=ref,
                           naive=naive, faiss=faiss_time, vs_faiss=vs_faiss,
                           faiss_setup=describe(flat[B][1]) if flat[B][1] else "", topk=topk, tower=tower,
                           gbs=n * per_ad / ours / 1e9, gflops=B * n * eligible * FLOPS_PER_PAIR / ours / 1e9, gated=gated)
                rows.append(row)
                print(line(row, read_bw, peak))
            on = None  # frees the device copy before the next storage
        flat_scan = None
        if not args.no_write:  # after each size: a run cut short (time, memory) keeps the sizes it finished
            measured = argparse.Namespace(**{**vars(args), "tile": args.tile[:done]})  # the sizes done so far
            write_section(f"kernels-{dev}", report(rows, args, command_line("benchmarks.kernels", p, measured), copy,
                                                   read_bw, peak))


def gated_share(args_: tuple) -> tuple[float, bool]:
    """(the share of (block, request) pairs whose gating the Triton pass computed: 1 where it kept per-block top-k,
    below 1 where its threshold scan skipped blocks that could not reach tau; whether it took the threshold scan)."""
    from kernels.triton import fused

    stats = {}
    fused.fused_scan(*args_, K, stats=stats)
    threshold = stats["path"] == "threshold"
    return (float(stats["scored"].float().mean()) / stats["blocks"] if threshold else 1.0), threshold


def share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def faiss_flat(vectors: torch.Tensor):
    """FAISS IndexFlatIP over (n, S) fp32 vectors: queries (B, S) -> its top-K search."""
    import faiss

    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors.numpy())
    return lambda queries: flat.search(queries, K)


def faiss_best(search, queries: np.ndarray, threads: int, repeats: int) -> tuple[float, tuple[int, int]]:
    """FAISS's fastest time for these queries (the median of `repeats`) over its settings that change speed, and
    which (threads, BLAS threshold): 1 or `threads` OpenMP threads (with fewer queries than threads, FAISS 1.15 splits the table between
    threads, which on 2 cores took twice the time of one thread), and BLAS or its own loop for the distances
    (distance_compute_blas_threshold: 1.15's default, 128,000 queries, keeps every batch here off BLAS; 20, the
    earlier default, sends batches of 20 and more to it). Leaves FAISS at `threads` threads and its default
    threshold."""
    import faiss

    default = faiss.cvar.distance_compute_blas_threshold
    best = (float("inf"), (threads, default))
    for setting in ((n_threads, blas) for n_threads in sorted({1, threads}) for blas in sorted({default, 20})):
        with faiss_setting(*setting, threads):
            best = min(best, (median_seconds(lambda: search(queries), repeats), setting))
    return best


@contextlib.contextmanager
def faiss_setting(threads: int, blas: int, after: int):
    """FAISS at `threads` OpenMP threads, computing distances with BLAS from `blas` queries, inside; after, at `after`
    threads and its default BLAS threshold. FAISS and torch share one OpenMP runtime here, so torch runs at those
    thread counts too."""
    import faiss

    default = faiss.cvar.distance_compute_blas_threshold
    faiss.omp_set_num_threads(threads)
    faiss.cvar.distance_compute_blas_threshold = blas
    try:
        yield
    finally:
        faiss.omp_set_num_threads(after)
        faiss.cvar.distance_compute_blas_threshold = default


def describe(setting: tuple[int, int]) -> str:
    threads, blas = setting
    return f"{threads} thread{'s' if threads > 1 else ''}, BLAS from {blas:,} queries"


def versus_flat(ours, flat_scan, queries: np.ndarray, flat: tuple[float, tuple[int, int] | None], device: str,
                args) -> tuple[float, float, float]:
    """(our seconds, the flat scan's seconds, its time over ours). On the CPU the two are timed in turn over
    args.rounds rounds, FAISS at its fastest setting (flat: faiss_best's): medians, and the median of the rounds'
    ratios. On a GPU, where the stand-in's copy of the vectors is freed before ours is made, ours is timed alone
    (the median of args.repeats) against the stand-in's time flat[0]."""
    if device != "cpu":
        seconds = timed(ours, device, args.repeats)
        return seconds, flat[0], flat[0] / seconds
    import faiss

    def ours_at_its_threads():  # FAISS and torch share one OpenMP runtime: FAISS's thread count is torch's too
        torch.set_num_threads(args.threads)
        ours()

    def faiss_at_its_threads():
        faiss.omp_set_num_threads(flat[1][0])
        flat_scan(queries)

    with faiss_setting(*flat[1], args.threads):
        times = timed_in_turn({"ours": ours_at_its_threads, "faiss": faiss_at_its_threads}, args.rounds)
    return (statistics.median(times["ours"]), statistics.median(times["faiss"]),
            statistics.median(f / o for o, f in zip(times["ours"], times["faiss"])))


def torch_flat(vectors: torch.Tensor, times: int, device: str):
    """The GPU stand-in for FAISS's flat scan (the image has no faiss-gpu): one fp16 GEMM over the (n, S)
    vectors tiled `times` times, then torch.topk; queries (B, S) -> (B, K)."""
    table = vectors.half().to(device).repeat(times, 1)
    return lambda queries: (torch.from_numpy(queries).to(device).half() @ table.T).topk(K, dim=1)


def towers(device: str, B: int):
    """The MoE's user towers as served (default Dims, random weights): B requests with full histories (the last
    50 engagements), 8 co-engagements and 32 segments -> their kernel head; a callable to time."""
    d = Dims()
    model = RetrievalModel("moe", d, np.arange(1000)).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = UserInputs(torch.randn((B, d.history, d.stored), generator=gen), torch.zeros((B, d.history), dtype=torch.int64),
                        torch.rand((B, d.history), generator=gen) * 1000, torch.ones((B, d.history), dtype=torch.bool),
                        torch.randint(0, d.segment_buckets, (B, SEGMENTS), generator=gen), torch.ones((B, SEGMENTS), dtype=torch.bool),
                        torch.randn((B, CO_ITEMS, d.stored), generator=gen), torch.ones((B, CO_ITEMS), dtype=torch.bool),
                        torch.zeros((B, 3), dtype=torch.int64)).to(device)

    @torch.no_grad()
    def run():
        return model.head.kernel_head(model.users(inputs))
    return run


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def times_ours(r: dict) -> str:
    return f"{r['vs_faiss']:.2f}x"


def line(r: dict, read_bw: float, peak: float) -> str:
    return (f"{r['n']:>11,} ads {r['storage']} B={r['B']:<3} ours {ms(r['ours']):>8} ms "
            f"({r['n'] / r['ours'] / 1e6:8.1f}M ads/s, {r['n'] * r['B'] / r['ours'] / 1e6:9.1f}M pairs/s, "
            f"{r['per_ad']:.0f} B/ad, {r['gbs']:.1f} GB/s = {r['gbs'] / read_bw:.0%} of read, "
            f"{r['gflops']:.1f} GFLOP/s = {r['gflops'] / peak:.1%} of matmul)  eligible {r['eligible']:.1%}, rows read {r['read']:.1%}  "
            f"match alone {ms(r['match'])} ms ({r['n'] / r['match'] / 1e9:.2f}G ads/s)  "
            f"reference {ms(r['ref'])}  naive {ms(r['naive'])}  FAISS {ms(r['faiss'])} ({times_ours(r)}"
            f"{'; ' + r['faiss_setup'] if r['faiss_setup'] else ''})  "
            f"topk {ms(r['topk'])}  with the user towers {ms(r['tower'] + r['ours'])} ms "
            f"({r['n'] / (r['tower'] + r['ours']) / 1e6:.1f}M ads/s)  blocks gated {share(r['gated'])}")


def report(rows: list[dict], args, command: str, copy: float, read_bw: float, peak: float) -> str:
    """The section of docs/benchmarks.md for the rows measured so far, by the `command` that measured them."""
    cpu = args.device == "cpu"
    table = ["| ads | storage | B | ours ms | ads/s | pairs/s | bytes/ad | GB/s | share of read bw | share of copy bw "
             "| GFLOP/s | share of peak FLOPs | eligible | rows read | match alone ms (ads/s) | reference ms | naive ms "
             "| FAISS ms | FAISS time / ours | torch.topk ms | with the user towers ms (ads/s) | blocks gated |",
             "|---" * 22 + "|"]
    for r in rows:
        table.append(f"| {r['n']:,} | {r['storage']} | {r['B']} | {ms(r['ours'])} | {r['n'] / r['ours'] / 1e6:.1f}M | "
                     f"{r['n'] * r['B'] / r['ours'] / 1e6:.1f}M | {r['per_ad']:.0f} | {r['gbs']:.1f} | "
                     f"{r['gbs'] / read_bw:.0%} | {r['gbs'] / copy:.0%} | {r['gflops']:.1f} | {r['gflops'] / peak:.1%} | "
                     f"{r['eligible']:.1%} | {r['read']:.1%} | {ms(r['match'])} ({r['n'] / r['match'] / 1e9:.2f}G) | "
                     f"{ms(r['ref'])} | {ms(r['naive'])} | "
                     f"{ms(r['faiss'])} | {times_ours(r)} | {ms(r['topk'])} | "
                     f"{ms(r['tower'] + r['ours'])} ({r['n'] / (r['tower'] + r['ours']) / 1e6:.1f}M) | {share(r['gated'])} |")
    setups = sorted({(r["B"], r["faiss_setup"]) for r in rows if r["faiss_setup"]})
    if cpu:
        rows_text = ("the vector rows of the \"rows read\": the ads some request of the batch is eligible for, whose row "
                     "the pass reads once for all of them, counted in the 64-byte cache lines they occupy (an fp16 row's "
                     "80 dims and bias span 4 lines; an int8 row's 2, and 1 of scales)")
    else:
        from kernels.triton.fused import MATCHED_ROWS_MAX_B

        rows_text = (f"for batches of up to {MATCHED_ROWS_MAX_B} requests the vector rows of the \"rows read\" (the "
                     "Triton scan matches a block first and loads only the rows some request matched), for larger "
                     "batches every ad's row (it loads a block's rows before it knows which of them match), counted in "
                     "the 32-byte sectors they occupy; where it takes the threshold scan, its sample of 1 block in 16 "
                     "again")
    faiss_text = (f"FAISS = {FLAT[cpu]}, at its fastest, chosen once per size and batch, of 1 or {args.threads} threads "
                  f"and BLAS from 20 queries or from 1.15's default of 128,000 (" +
                  "; ".join(f"B = {B}: {setup}" for B, setup in setups) + f"), then timed in turn with ours over "
                  f"{args.rounds} rounds: their times are the medians of those rounds, and FAISS time / ours is the "
                  f"median of the rounds' ratios (runs apart on these shared machines swing by tens of percent)"
                  ) if cpu else f"FAISS = {FLAT[cpu]}"
    return f"""## Fused kernels on {args.device} ({dispatch.implementation(args.device)}) beside their peers

`{command}`

Machine: {machine()}. Measured in the same run: read bandwidth {read_bw:.1f} GB/s (summing 1 GiB), copy bandwidth
{copy:.1f} GB/s (read + write), peak FLOP rate
{peak:,.0f} GFLOP/s (one {"fp32 matmul of 2048 x 2048" if cpu else "fp16 matmul of 8192 x 8192"}).
Table: the synthetic world of {args.ads:,} ads (tiled for larger corpora: the same ads over again, so a tiled table
keeps the world's clause dictionary, and a request's table of clause bits stays as small as at {args.ads:,} ads, where a
corpus of that many distinct ads would have more clauses), random vectors of the MoE's
stored shape (S = {S}), the world's requests with random user experts (E = {E}, top {TOP_N}; the same for both
storages); k = {K}.
Ours = `kernels.dispatch.fused_scan`; "match alone" = `kernels.dispatch.clause_match` (the standalone
match, writing the (B, n) eligibility mask); bytes/ad counts what the fused pass reads: {MATCH_BYTES} B of status and
window and 4 B per clause ref per ad, plus {rows_text}; "eligible" is the mean share per request. The shares of
bandwidth divide those bytes per second by the read bandwidth (the scan only reads) and by the copy bandwidth.
Pairs/s counts every user-ad pair of the batch, eligible or not. GFLOP/s counts the MoE head's {FLOPS_PER_PAIR} FLOPs
per eligible user-ad pair as the reference computes it (gating logits, every expert's similarity, top-{TOP_N} softmax,
gated sum, bias; {FLOPS_PER_PAIR - 2 * (E - TOP_N) * D} if only the chosen experts' similarities were computed; the passes
also skip work that cannot enter the top-k, the CPU pass an ad's gating and the GPU pass whole blocks). {faiss_text}.
Reference and naive are run only up to {args.peer_pairs:,.0f} user-ad
pairs ("-" beyond). "With the user towers" adds the time of the MoE's user towers for the B requests (default
sizes, random weights, full histories) and their kernel head, on the same device: end to end but for the
request's parsing and lookups. "Blocks gated" (CUDA): the share of (block of 128 ads, request) pairs whose gating the
threshold scan computed; it skips a block where no eligible ad's largest similarity plus bias reaches the request's
lower bound tau of its m-th best. Times are medians of {args.repeats} (reference and naive: one run; on the CPU ours
and FAISS: of the rounds in turn).

{chr(10).join(table)}
"""


if __name__ == "__main__":
    main()
