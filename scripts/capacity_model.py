"""Capacity model of the service: ads per GPU, QPS per replica, shards and replicas for a corpus at a QPS and
p99 budget, network bytes per request, and the update stream per Redis node. Reads scripts/capacity_inputs.json
(measured figures from docs/benchmarks.md with their sections; stated hardware limits and assumptions) and
writes docs/scaling.md.

    python scripts/capacity_model.py            # rewrites docs/scaling.md
    python scripts/capacity_model.py --check    # exit 1 when docs/scaling.md is not what the inputs give

The headroom alert of k8s/ (AndromedaIndexMemoryHeadroom) takes its threshold from headroom_slots().
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ROOT / "scripts" / "capacity_inputs.json"
OUT = ROOT / "docs" / "scaling.md"
ROW_ALIGN = 64  # bytes: AdIndex pads each stored vector's row to whole cache lines (andromeda_core.quantization)
STORAGES = ("fp32", "fp16", "int8")


def load_inputs(path: Path = INPUTS) -> dict:
    """The inputs with every {"value": x, "source": ...} entry flattened to x (the sources stay in `raw`)."""
    raw = json.loads(path.read_text())
    flat = {section: {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in entries.items()}
            for section, entries in raw.items() if isinstance(entries, dict)}
    return {**flat, "raw": raw}


def vector_bytes(storage: str, dims: int, block: int = 16, line: int = 0) -> int:
    """Bytes of one stored vector of `dims` dims: fp32, fp16, or int8 with one fp32 scale per block; with `line`,
    its row of values padded to whole lines of that many bytes (how AdIndex holds them)."""
    row = {"fp32": 4 * dims, "fp16": 2 * dims, "int8": dims}[storage]
    scales = 4 * math.ceil(dims / block) if storage == "int8" else 0
    return (-(-row // line) * line if line else row) + scales


@dataclass(frozen=True)
class AdBytes:
    held: int        # device memory per slot
    targeting: int   # read for every ad by every pass
    vector: int      # read for an ad that some request of the pass is eligible for


def ad_bytes(inputs: dict, storage: str, rescore: int) -> AdBytes:
    m = inputs["model"]
    exact = 4 * m["dim"] if storage != "fp32" and rescore > 0 else 0  # the float32 copy a lossy table keeps for rescoring
    held = m["targeting_bytes"] + m["held_meta_bytes"] + vector_bytes(storage, m["dim"], m["int8_block"], ROW_ALIGN) + exact
    return AdBytes(held, m["targeting_bytes"], vector_bytes(storage, m["scan_dims"], m["int8_block"]))


def snapshot_bytes(inputs: dict, storage: str, rescore: int) -> int:
    """Bytes per ad of a snapshot file: what a slot holds, without the padding of its vector's row."""
    m = inputs["model"]
    exact = 4 * m["dim"] if storage != "fp32" and rescore > 0 else 0
    return m["targeting_bytes"] + m["held_meta_bytes"] + vector_bytes(storage, m["dim"], m["int8_block"]) + exact


def largest_table(initial: int, threshold: int) -> int:
    """The most slots a table that starts at `initial` and doubles reaches before its headroom alert (threshold)
    warns that the next doubling would not fit: the first capacity past the threshold."""
    capacity = initial
    while capacity <= threshold:
        capacity *= 2
    return capacity


def gpu_host_bytes(inputs: dict, storage: str, rescore: int, ads: int) -> float:
    """Host memory a GPU shard replica needs to load a snapshot of `ads` ads: its process before the table, the
    file's tensors (read whole into host memory before they go to the GPU) and the index's bookkeeping (ids,
    versions, free slots, clause dictionary: Python objects on the host) at the load's peak."""
    return (inputs["assumed"]["gpu_replica_process_bytes"]
            + ads * (snapshot_bytes(inputs, storage, rescore) + inputs["measured"]["host_bookkeeping_bytes_per_ad"]))


def headroom_slots(bytes_per_slot: int, memory_bytes: float, usable_fraction: float, replicas_sharing: int) -> int:
    """The table capacity past which its next doubling (old + new columns: 3x while it copies) no longer fits
    in a replica's share of the memory: the threshold of the AndromedaIndexMemoryHeadroom alert."""
    return int(memory_bytes * usable_fraction / replicas_sharing / (3 * bytes_per_slot))


def pass_seconds(inputs: dict, ads: float, batch: int, b: AdBytes) -> tuple[float, str]:
    """One fused pass of `batch` requests over `ads` slots: (seconds, what bounds it). Targeting bytes are read
    once per pass; an ad's vector once if any request of the batch is eligible for it."""
    h, a = inputs["hardware"], inputs["assumed"]
    if "pass_rates" in inputs:  # the plan at the rates measured (at_measured_rates)
        return ads * batch / measured_rate(inputs["pass_rates"], batch) + a["pass_overhead_s"], "measured"
    eligible = inputs["measured"]["eligible_fraction"]
    any_eligible = 1 - (1 - eligible) ** batch
    memory = ads * (b.targeting + any_eligible * b.vector) / (h["gpu_bandwidth_bytes_per_s"] * a["kernel_bandwidth_efficiency"])
    compute = ads * eligible * batch * a["moe_flops_per_pair"] / (h["gpu_fp32_flops"] * a["kernel_compute_efficiency"])
    bound = "memory" if memory >= compute else "compute"
    return max(memory, compute) + a["pass_overhead_s"], bound


@dataclass(frozen=True)
class ReplicaPlan:
    batch: int
    pass_s: float
    bound: str
    qps: float          # at the planned utilisation
    p99_s: float        # batch wait + a pass it queues behind + its own pass


def replica_plan(inputs: dict, ads: float, b: AdBytes) -> ReplicaPlan | None:
    """The largest batch (a power of two up to max_batch) whose p99 fits the shard budget; None if none does."""
    w, a = inputs["workload"], inputs["assumed"]
    best = None
    batch = 1
    while batch <= w["max_batch"]:
        seconds, bound = pass_seconds(inputs, ads, batch, b)
        p99 = w["batch_wait_s"] + 2 * seconds
        if p99 <= w["shard_p99_budget_s"]:
            best = ReplicaPlan(batch, seconds, bound, batch / seconds * a["utilisation"], p99)
        batch *= 2
    return best


@dataclass(frozen=True)
class Deployment:
    ads: int
    qps: int
    shards: int
    replicas: int
    plan: ReplicaPlan
    memory_shards: int

    @property
    def gpus(self) -> int:
        return self.shards * self.replicas


def plan_deployment(inputs: dict, ads: int, qps: int, b: AdBytes) -> Deployment:
    """Fewest GPUs for `ads` at `qps` within the budgets: shards at least what memory needs (tables planned
    `table_fill` full) and at most max_fanout, replicas at least min_replicas. Ties go to more shards: smaller
    tables load and recover faster, each replica applies fewer updates, and a pass is shorter."""
    h, a, w = inputs["hardware"], inputs["assumed"], inputs["workload"]
    per_gpu = h["gpu_memory_bytes"] * a["gpu_memory_usable_fraction"] * a["table_fill"] / b.held
    memory_shards = math.ceil(ads / per_gpu)
    best = None
    for shards in range(memory_shards, max(memory_shards, w["max_fanout"]) + 1):
        plan = replica_plan(inputs, ads / shards, b)
        if plan is None:
            continue
        replicas = max(w["min_replicas"], math.ceil(qps / plan.qps))
        d = Deployment(ads, qps, shards, replicas, plan, memory_shards)
        if best is None or d.gpus <= best.gpus:
            best = d
    if best is None:
        raise ValueError(f"no shard count up to {max(memory_shards, w['max_fanout'])} meets the budget for {ads} ads")
    return best


PROD = (100_000_000, 20_000)  # the (ads, QPS) row the gpu-prod overlay is sized for


def measured_rate(rates: dict[int, float], batch: int) -> float:
    """User-ad pairs/s of a pass of `batch` requests: the measured rates {batch: pairs/s}, linear in log2(batch)
    between the batches measured, the nearest one's beyond them."""
    points = sorted(rates.items())
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if batch <= b1:
            t = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return r0 + t * (r1 - r0)
    return points[-1][1]


def at_measured_rates(inputs: dict) -> dict:
    """The inputs with the pass timed from the H200's measured pairs/s by batch (pass_seconds) instead of the
    bandwidth and FLOPs the kernel is assumed to reach."""
    return {**inputs, "pass_rates": {int(k): v for k, v in inputs["measured"]["gpu_pairs_per_s"].items()}}


def initial_capacity(inputs: dict, d: Deployment) -> int:
    """Slots to allocate per table up front (a power of two), so the planned corpus fills it table_fill."""
    return 1 << math.ceil(math.log2(d.ads / d.shards / inputs["assumed"]["table_fill"]))


def routers(inputs: dict, qps: int) -> int:
    m, a = inputs["measured"], inputs["assumed"]
    return max(2, math.ceil(qps * m["router_cpu_ms_per_request"] / 1000 / (a["router_cores"] * a["utilisation"])))


def network_bytes(inputs: dict, ads: int, shards: int, b: AdBytes) -> dict[str, float]:
    """Bytes on the network per request: our co-located top-k, shipping every eligible candidate's id and score
    to the router, and shipping candidates with their vectors to a separate scoring tier."""
    m = inputs["measured"]
    client = m["request_json_bytes"] + m["response_json_bytes"]
    history = m["history_lookup_bytes"]
    eligible = ads * m["eligible_fraction"]
    return {
        "co-located top-k (this design)": client + history + shards * (m["user_query_bytes"] + m["shard_answer_bytes"]),
        "shards ship every eligible candidate (id + score)": client + history + shards * m["user_query_bytes"]
        + eligible * m["candidate_bytes"],
        "retrieval ships candidates to a scoring tier (id + vector)": client + history + shards * m["user_query_bytes"]
        + eligible * (8 + b.vector),
    }


def entry_bytes(inputs: dict) -> int:
    m, model = inputs["measured"], inputs["model"]
    return m["upsert_entry_bytes_64d"] + 4 * (model["dim"] - model["baseline_dim"])  # the entry carries float32 vectors


def redis_node(inputs: dict, readers: int) -> dict[str, float]:
    """Events/s one Redis node carries when every entry is read by `readers` replicas, and what bounds it."""
    h, a = inputs["hardware"], inputs["assumed"]
    size = entry_bytes(inputs)
    cpu = a["redis_entries_per_s"] / (1 + readers * a["redis_read_cost"])
    nic = h["redis_node_nic_bytes_per_s"] * 0.6 / (size * (1 + readers))
    return {"cpu": cpu, "nic": nic, "events_per_s": min(cpu, nic), "bound": "CPU" if cpu <= nic else "network"}


# -- the report ---------------------------------------------------------------------------------------------


def fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def deployment_table(inputs: dict, b: AdBytes, out: list[str]) -> dict[tuple[int, int], Deployment]:
    """Appends the deployment table to out, a row for each corpus and QPS of the workload; returns the plans."""
    out += ["| ads | QPS | shards (memory needs) | ads per shard | batch | pass | p99 at the shard | replicas per shard "
            "| GPUs | routers |", "|---|---|---|---|---|---|---|---|---|---|"]
    plans = {}
    for ads in inputs["workload"]["corpora"]:
        for qps in inputs["workload"]["qps"]:
            d = plans[(ads, qps)] = plan_deployment(inputs, ads, qps, b)
            out.append(f"| {fmt(ads / 1e6)}M | {fmt(qps)} | {d.shards} ({d.memory_shards}) | {fmt(ads / d.shards / 1e6, 1)}M | "
                       f"{d.plan.batch} | {d.plan.pass_s * 1e3:.2f} ms | {d.plan.p99_s * 1e3:.1f} ms | {d.replicas} | {d.gpus} | "
                       f"{routers(inputs, qps)} |")
    return plans


def report(inputs: dict) -> str:
    h, a, m, w, model = inputs["hardware"], inputs["assumed"], inputs["measured"], inputs["workload"], inputs["model"]
    raw = inputs["raw"]
    usable = h["gpu_memory_bytes"] * a["gpu_memory_usable_fraction"]
    out = ["# Scaling: a capacity model", "",
           "Generated by `python scripts/capacity_model.py` from `scripts/capacity_inputs.json`: do not edit by hand",
           "(a test fails when this page is not what the inputs give). Measured figures come from",
           "[docs/benchmarks.md](benchmarks.md), each with its section below; GPU figures are **stated hardware limits",
           "and assumptions, not measurements**: every GPU row but those of the section 'At the rates measured on one",
           "H200' rests on the fused kernel reaching its design target (85% of the HBM bandwidth), which the GPU "
           "measurements so far (an H200, an H100) do",
           "not. Replace an assumption in the inputs once it is measured and rerun the script.", "",
           f"Hardware: {h['note']}", "",
           "## Bytes per ad", "",
           model["note"], "",
           "A pass reads every ad's targeting and, for an ad at least one request of the batch is eligible for, its",
           f"vector: with a measured eligible share e = {m['eligible_fraction']:.1%} per request, a batch of B requests reads",
           "a vector with probability 1 - (1 - e)^B.", "",
           f"| storage | rescore | held per ad | read per ad, 1 request | read per ad, batch of 16 | ads per {h['gpu']} "
           f"({a['gpu_memory_usable_fraction']:.0%} usable, tables {a['table_fill']:.0%} full) | ads/s one request "
           f"at {a['kernel_bandwidth_efficiency']:.0%} of {h['gpu_bandwidth_bytes_per_s'] / 1e12:.1f} TB/s |",
           "|---|---|---|---|---|---|---|"]
    e = m["eligible_fraction"]
    for storage in STORAGES:
        for rescore in ((2, 0) if storage != "fp32" else (2,)):
            b = ad_bytes(inputs, storage, rescore)
            one = b.targeting + e * b.vector
            sixteen = b.targeting + (1 - (1 - e) ** 16) * b.vector
            rate = h["gpu_bandwidth_bytes_per_s"] * a["kernel_bandwidth_efficiency"] / one
            out.append(f"| {storage} | {'on' if rescore else 'off'} | {b.held} B | {one:.1f} B | {sixteen:.1f} B | "
                       f"{fmt(usable * a['table_fill'] / b.held / 1e6)}M | {fmt(rate / 1e9, 1)}B |")
    b = ad_bytes(inputs, w["storage"], w["rescore"])
    out += ["", f"The plan below uses {w['storage']} storage with rescoring on ({b.held} B held, {b.targeting} + "
                f"{b.vector} B read): the exact copy costs memory, not bandwidth.", "",
            "## QPS per replica", "",
            f"A shard replica answers batches of up to {w['max_batch']} requests with one pass. A pass takes the larger of",
            f"its bytes at {a['kernel_bandwidth_efficiency']:.0%} of the HBM bandwidth and its MoE FLOPs "
            f"({a['moe_flops_per_pair']} per pair) at {a['kernel_compute_efficiency']:.0%} of the fp32 peak, plus "
            f"{a['pass_overhead_s'] * 1e3:.1f} ms. p99 at the shard = batch wait ({w['batch_wait_s'] * 1e3:.0f} ms) + one "
            f"pass queued behind + its own pass, within a shard budget of {w['shard_p99_budget_s'] * 1e3:.0f} ms "
            f"(of {w['router_p99_budget_s'] * 1e3:.0f} ms at the router); replicas planned at "
            f"{a['utilisation']:.0%} busy.", "",
            "| ads per shard | batch | pass | bound by | p99 at the shard | QPS per replica |", "|---|---|---|---|---|---|"]
    for ads in (1e6, 12.5e6, 50e6, 125e6, 150e6):
        p = replica_plan(inputs, ads, b)
        if p is None:
            out.append(f"| {fmt(ads / 1e6, 1)}M | - | - | - | over budget | - |")
        else:
            out.append(f"| {fmt(ads / 1e6, 1)}M | {p.batch} | {p.pass_s * 1e3:.2f} ms | {p.bound} | {p.p99_s * 1e3:.1f} ms | "
                       f"{fmt(p.qps)} |")
    out += ["", "Measured on CPU, the only measurement of a replica so far (docs/benchmarks.md, 'Serving under load', one",
            f"shard replica of 0.5 CPU on the 2-core box): {m['cpu_replica_qps']} QPS over HTTP within the latency limits and "
            f"{m['cpu_in_process_qps']} in process, for {fmt(m['cpu_ads'])} ads. "
            f"Routers: {m['router_cpu_ms_per_request']} ms of CPU per request measured (plus {m['proxy_cpu_ms_per_request']} ms "
            f"in the Serve proxy), so a {a['router_cores']}-core router takes about "
            f"{fmt(a['router_cores'] * a['utilisation'] * 1000 / m['router_cpu_ms_per_request'])} QPS.", "",
            "## Shards and replicas", "",
            "Shards: at least what memory needs, at most a fan-out of "
            f"{w['max_fanout']} (every request visits one replica of every shard); then",
            "the count that needs the fewest GPUs while a pass fits the p99 budget, ties going to more shards (smaller",
            "tables load and recover faster, each replica applies fewer updates, a pass is shorter). Replicas per",
            f"shard: the QPS over one replica's, at least {w['min_replicas']} (one may fail or be upgraded). "
            "GPUs = shards x replicas.", ""]
    plans = deployment_table(inputs, b, out)
    r20 = routers(inputs, w["qps"][-1])
    prod = plans[PROD]
    out += ["", "When the pass is compute-bound, shards do not change the GPU count (every request does the same MoE work",
            "in total); they cut the pass time, the memory per GPU and the updates each replica applies.", "",
            f"The gpu-prod overlay is the {fmt(prod.ads / 1e6)}M-ad row at {fmt(prod.qps)} QPS: {prod.shards} shards, "
            f"autoscaling from {prod.replicas} replicas per shard",
            f"to twice that, initial_capacity {fmt(initial_capacity(inputs, prod))} slots per table "
            f"({a['table_fill']:.0%} full at {fmt(prod.ads / prod.shards / 1e6, 1)}M ads); a test keeps k8s/overlays/gpu-prod "
            "equal to this plan.", "",
            f"**The routers, not the GPUs, dominate the cost at scale**: {fmt(r20)} routers of {a['router_cores']} cores at "
            f"{fmt(w['qps'][-1])} QPS, from the",
            f"{m['router_cpu_ms_per_request']} ms of CPU per request measured on the 2-core box (parsing, the user towers in "
            "torch on CPU, pickling,",
            "scatter/gather). The gpu-prod overlay starts 4 routers (about "
            f"{fmt(4 * a['router_cores'] * a['utilisation'] * 1000 / m['router_cpu_ms_per_request'])} QPS at that cost): "
            "raise router_replicas and the cpu-workers group together",
            "(docs/operations.md, 'Scale replicas'), and measure the router on the production CPUs first.", ""]
    measured = at_measured_rates(inputs)
    rates = measured["pass_rates"]
    target_one, _ = pass_seconds(inputs, 1e8, 1, b)
    out += ["## At the rates measured on one H200", "",
            "One H200 measured the Triton pass (docs/benchmarks.md, 'The H200 session of 2026-11-30', 100M ads, int8) at "
            + ", ".join(f"{fmt(r / 1e9, 1)}G" for r in rates.values()) + " user-ad pairs/s for batches of "
            + ", ".join(map(str, rates)) + f" requests: one request over 100M ads in {1e8 / rates[1] * 1e3:.1f} ms, where the",
            f"model above takes {target_one * 1e3:.2f} ms. Here a pass takes ads x batch / the measured pairs/s (linear in log2 of the",
            f"batch between those measured) + {a['pass_overhead_s'] * 1e3:.1f} ms; smaller tables measured somewhat slower per ad "
            "(a fixed cost of about 2 ms",
            "per call on that H200, 0.9 ms on an H100 since: docs/benchmarks.md), which this leaves out. Until the kernel reaches its target, plan with these rows:",
            ""]
    at_measured = deployment_table(measured, b, out)
    ratio = at_measured[PROD].gpus / prod.gpus
    out += ["", f"The gpu-prod overlay is sized at the target rates: at the measured ones its row needs "
                f"{at_measured[PROD].gpus} GPUs, {ratio:.1f}x its {prod.gpus}.", "",
            "## Network bytes per request", "",
            "From the message sizes measured in docs/benchmarks.md ('Serving under load', 'Bytes per request between",
            "router and shards'): request and response JSON, the history lookup, and per shard a UserQuery and a top-100",
            f"answer; the shipped-candidate columns use the measured eligible share ({e:.1%}).", "",
            "| ads | shards | " + " | ".join(network_bytes(inputs, 1, 1, b)) + " |", "|---|---|---|---|---|"]
    for ads in w["corpora"]:
        d = plans[(ads, w["qps"][-1])]
        out.append(f"| {fmt(ads / 1e6)}M | {d.shards} | " + " | ".join(human_bytes(v) for v in network_bytes(inputs, ads, d.shards, b).values()) + " |")
    size = entry_bytes(inputs)
    out += ["", "Co-location keeps a request to a few kB whatever the corpus; shipping candidates grows with it.", "",
            "## Update stream per Redis node", "",
            f"An upsert entry is {size:,} bytes: {m['upsert_entry_bytes_64d']:,} measured (the fields index_updater.records.encode",
            "writes for 2,046 synthetic upserts, mean, with the 64-dim baseline vector; not in docs/benchmarks.md) plus",
            f"4 B per extra dim of the {model['dim']}-dim model. Every replica of a shard reads every entry of its shard's stream, so",
            "a node's egress is the write rate times the replicas per shard. A node's limit is the smaller of its CPU",
            f"({fmt(a['redis_entries_per_s'])} XADDs/s, each reader costing {a['redis_read_cost']} of an XADD per entry) and",
            f"60% of its NIC ({human_bytes(h['redis_node_nic_bytes_per_s'])}/s); both assumed, measure them on the node.", "",
            "| replicas per shard | events/s per node | bound by | egress at that rate |", "|---|---|---|---|"]
    for readers in (1, 2, 4, 8):
        r = redis_node(inputs, readers)
        out.append(f"| {readers} | {fmt(r['events_per_s'])} | {r['bound']} | {human_bytes(r['events_per_s'] * size * readers)}/s |")
    day = w["events_per_s"] * size * a["redis_memory_overhead"] * w["retention_s"]
    out += ["", f"Measured (docs/benchmarks.md, 'Update apply rate and freshness', one shard replica on the 2-core box): "
                f"{fmt(m['apply_events_per_s'])} events/s applied from a backlog, {fmt(m['apply_events_per_s_serving'])} while serving;",
            f"p99 publish -> servable {m['freshness_p99_ms_at_10k']:.0f} ms at 10,000 events/s. A shard's replicas apply",
            "only their shard's entries, so S shards apply S times that in total.", "",
            f"Memory: streams keep every entry until trimmed. At {fmt(w['events_per_s'])} events/s that is "
            f"{human_bytes(day)} per {w['retention_s'] / 3600:.0f} h in Redis (and on its AOF disk). The service trims",
            "them only with `trim` set in its config, off by default (docs/operations.md, 'Trimming the streams'): size",
            "Redis for the retention you keep.",
            "A Redis Cluster would spread the per-shard streams over nodes, but the service's client is single-node",
            "today (docs/operations.md, 'Managed Redis or Redis Cluster').", "",
            "## Headroom alert thresholds", "",
            "AndromedaIndexMemoryHeadroom fires when a shard's table is over 80% full and its capacity is past the",
            "point where the next doubling (old and new columns, 3x, while it copies) no longer fits the replica's",
            "memory share: the thresholds in k8s/ come from `headroom_slots` here (a test keeps them equal).", ""]
    for name, (storage, rescore, memory, fraction, sharing) in overlay_memory(inputs).items():
        bb = ad_bytes(inputs, storage, rescore)
        out.append(f"- {name}: {storage}, rescore {'on' if rescore else 'off'} ({bb.held} B per slot), "
                   f"{human_bytes(memory)} x {fraction:.0%} shared by {sharing} replica(s): "
                   f"{fmt(headroom_slots(bb.held, memory, fraction, sharing))} slots.")
    _, rescore, memory, fraction, sharing = overlay_memory(inputs)["gpu-prod"]
    biggest = largest_table(initial_capacity(inputs, prod),
                            headroom_slots(ad_bytes(inputs, "int8", rescore).held, memory, fraction, sharing))
    m, a = inputs["measured"], inputs["assumed"]
    out += ["", "## Host memory of a GPU shard replica", "",
            "A GPU replica's table is on the GPU, but loading a snapshot reads the whole file into host memory first,",
            "and the index keeps the ids, versions and free slots of its ads and its clause dictionary as Python objects",
            f"on the host: {m['host_bookkeeping_bytes_per_ad']} B per ad at the load's peak (measured; see the inputs). "
            "A replica that restarts must",
            f"fit its process ({human_bytes(a['gpu_replica_process_bytes'])}, assumed) plus, per ad, the snapshot's bytes "
            "and that bookkeeping. Writing a",
            "snapshot in the background needs less: a host copy of the table with the bookkeeping once loaded.", "",
            f"gpu-prod: int8 with rescoring, {snapshot_bytes(inputs, 'int8', rescore)} B per ad in a snapshot; its tables start at "
            f"{fmt(initial_capacity(inputs, prod))} slots and",
            f"double up to {fmt(biggest)}, the first capacity past the headroom threshold, where the alert tells to add shards.",
            f"A full table of that size needs {human_bytes(gpu_host_bytes(inputs, 'int8', rescore, biggest))} of host memory to load; the "
            f"gpu-workers' pods have {GPU_POD_MEMORY / 2**30:.0f} GiB ({human_bytes(GPU_POD_MEMORY)})",
            "(a test keeps that limit and this plan together)."]
    out += ["", "## Inputs and where they come from", "", "| input | value | source |", "|---|---|---|"]
    for section in ("measured", "assumed"):
        for name, entry in raw[section].items():
            value = entry["value"]
            shown = ", ".join(f"{k}: {v:,}" for k, v in value.items()) if isinstance(value, dict) else f"{value:,}"
            out.append(f"| {section}: {name} | {shown} | {entry['source']} |")
    return "\n".join(out) + "\n"


GPU_POD_MEMORY = 96 * 2**30  # gpu-prod's gpu-workers memory limit (a test keeps them equal)


def overlay_memory(inputs: dict) -> dict[str, tuple[str, int, float, float, int]]:
    """(storage, rescore, memory bytes, usable fraction, shard replicas sharing it) of each overlay, as the
    k8s/ manifests configure them: cpu-dev's worker pod holds every shard replica (4 GiB limit); gpu-prod
    gives each replica one GPU."""
    a, h = inputs["assumed"], inputs["hardware"]
    return {"cpu-dev": ("fp32", 2, 4 * 2**30, a["cpu_memory_usable_fraction"], 2),
            "gpu-prod": ("int8", 2, h["gpu_memory_bytes"], a["gpu_memory_usable_fraction"], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/scaling.md is stale")
    args = p.parse_args(argv)
    text = report(load_inputs())
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"stale: {OUT} (run python scripts/capacity_model.py)", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
