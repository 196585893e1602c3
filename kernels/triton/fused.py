"""Triton fused retrieval pass: kernels.reference.fused.fused_scan (match, score, top-m) in one pass over the table.

Scan kernel: one program per block of BLOCK slots loads the block's status, time window, refs and vector columns
once, then serves every request of the batch: match, mixture-of-logits score, and what the block keeps of its
packed int64 keys. Merge kernel: rounds that fold FAN partials into one top-K until one remains per request, the
last round unpacking the keys into slots and scores.

The pass keeps few keys (memory B x candidates, not B x n): a first scan over every SAMPLE_STRIDE-th block keeps
each block's best key; the m-th best of those, tau (B,), is a lower bound of the m-th best key of the whole table
(m distinct keys reach it). The full scan then appends only the keys >= tau to a candidate buffer, which the
merge folds. Where too few blocks are sampled, or the candidates overflow their buffer (an adversarial slot
order), the scan keeps every block's top-m instead (exact too, B x n keys).

Scoring runs on tensor cores. A program loads its table tiles once (int32 offsets at a constant row stride from
one pointer, no bounds masks: the last block reads back over its neighbour's rows and leaves them ineligible; for
small batches a row mask leaves out the rows no request matched, MATCHED_ROWS_MAX_B); the
request side comes split on the host (mma_operand): each expert and each request's gating keys scaled by a power
of two, then rounded to float16 hi plus float16 lo = the rest. float16 tiles are exact as float16 and take two
float16 dots (hi, lo) with float32 accumulation; int8 tiles too (q is exact in float16), against a block-diagonal
operand whose column blocks the per-row scales of the SCALE_BLOCK-dim blocks then weight; float32 tiles take one
tf32x3 dot.

A key orders (score descending, slot ascending) as one int64 descending: the high 32 bits hold the score's float
bits made orderable as a signed integer, the low 32 bits 0xFFFFFFFF - slot. Ineligible slots hold NO_KEY.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.reference.fused import SCALE_BLOCK, in_parts
from kernels.triton.match import load_slots, match_request, refs_with_a_column

BLOCK = 128  # slots per program
SCAN_WARPS = 4  # on an H200 4 warps scanned fp16 1.6x faster than 8 (10M ads, B = 16, float32 dots then); with
# float16 dots int8 compiles at 4 too without spilling (ahead for sm_90), in fewer instructions per ad than at 8
SAMPLE_STRIDE = 16  # the threshold scan reads every 16th block
CANDIDATES = 64  # candidate keys kept per request: CANDIDATES * m (at least MIN_CANDIDATES) before the exact fallback
MIN_CANDIDATES = 8192
PER_BLOCK_BYTES = 1 << 31  # the per-block scan's partials, (B, blocks, width) int64, at most: past it (k = 10,000 on a
# 100M-ad table with 64 requests would take 51 GB) the requests go in parts, each a pass of its own
KEEP_TOP, KEEP_MAX, KEEP_ABOVE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # what a block keeps: its top WIDTH keys, its best key, the keys >= tau
SKIP_BELOW_TAU = True  # the threshold scan skips the gating of blocks that cannot reach tau (False: for A/B runs)
MATCHED_ROWS_MAX_B = 1  # batches of at most this many requests load only the vector rows some request matches (the
# masked-off rows' sectors are never fetched) and match each request twice; larger batches load every row of a block
# (0: always every row, for A/B runs). Measured on an H100 (fp16, 100M ads, 2026-12-05): B = 1 12.5 ms with it, 13.5
# without; B = 4 32.7 with it, 29.0 without (10M ads: 2.1 / 2.2 and 4.9 / 4.6). B = 2 and 3 were not measured
# Integers that change while serving (the table's rows, the batch, the clause words, the partials, k): not
# specialised, where Triton would compile a kernel again each time one became 1 or a multiple of 16, requests waiting.
UNSPECIALISED = {"_scan_kernel": ("n", "last", "B", "W"), "_merge_kernel": ("P", "m")}
MERGE_TILE = 2048  # keys a merge program selects from (more when m needs it)
MERGE_MAX_K = 2048  # the most keys a merge program keeps; a larger m merges with torch.topk (compiled for sm_90, a
# program keeping 8,192 spilled registers and one keeping 32,768, what k = 10,000 with rescoring asks, did not
# finish compiling in 500 s)
NO_KEY = -2**63

_NO_KEY = tl.constexpr(NO_KEY)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


def top_width(m: int) -> int:
    """The K of a tl.topk keeping the m best: a power of two, at least 2 (Triton 3.6, the H100 image's, cannot compile
    tl.topk for k = 1; the kernels store the first m)."""
    return max(triton.next_power_of_2(m), 2)


@triton.jit
def load_tile(rows_ptr, C0: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, KP: tl.constexpr,
              STRIDE: tl.constexpr, BLOCK: tl.constexpr, rows_ok=None):
    """Columns C0 .. C0 + KP of the BLOCK rows STRIDE elements apart from rows_ptr -> (BLOCK, KP) as stored, 0
    outside columns C0 + LO .. C0 + HI and in the rows rows_ok (BLOCK,) bool leaves out (None: none; a row left out
    is not read). Int32 offsets from one pointer: with STRIDE a constant each element is one load at an immediate
    offset of its thread's address, and the rows need no bounds mask (the caller keeps them in the table)."""
    k = tl.arange(0, KP)[None, :]
    ptrs = rows_ptr + tl.arange(0, BLOCK)[:, None] * STRIDE + (C0 + k)
    if LO > 0 or HI < KP:
        if rows_ok is not None:
            return tl.load(ptrs, mask=(k >= LO) & (k < HI) & rows_ok[:, None], other=0)
        return tl.load(ptrs, mask=(k >= LO) & (k < HI), other=0)
    if rows_ok is not None:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0)
    return tl.load(ptrs)


@triton.jit
def columns_dot(x, scale, hi_ptr, lo_ptr, BLOCK: tl.constexpr, EP: tl.constexpr):
    """A tile x (BLOCK, KP) of the table (as load_tile gives it) times the request's operand (KP, NS * EP) ->
    (BLOCK, EP) float32. float32 tables: one tf32x3 dot with hi (float32; NS = 1). float16 and int8 tables: the
    tile as float16 (exact) times hi + lo, the operand split into two float16 parts (fused_scan), two float16 dots
    accumulating in float32; int8 tables (NS column blocks of SCALE_BLOCK, each with its own scale per row; scale
    (BLOCK, NS) float32) get a block-diagonal operand, whose column block s holds the rows of scale column s, and
    the dot's NS column blocks are summed weighted by the scales."""
    KP: tl.constexpr = x.shape[1]
    NS: tl.constexpr = KP // _SCALE_BLOCK if x.dtype == tl.int8 else 1
    w = tl.arange(0, KP)[:, None] * (NS * EP) + tl.arange(0, NS * EP)[None, :]
    if x.dtype == tl.float32:
        sums = tl.dot(x, tl.load(hi_ptr + w), input_precision="tf32x3")
    else:
        x16 = x
        if x.dtype == tl.int8:  # float16 1024 + 128 + q has q + 128 as its low byte: two instructions, not three
            x16 = (x.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0
        sums = tl.dot(x16, tl.load(hi_ptr + w), tl.dot(x16, tl.load(lo_ptr + w)))
        if x.dtype == tl.int8:
            if NS == 1:
                sums = sums * scale
            else:
                sums = tl.sum(tl.reshape(sums, (BLOCK, NS, EP)) * scale[:, :, None], axis=1)
    return sums


@triton.jit
def expert_gates(logits, TOP_N: tl.constexpr, EP: tl.constexpr):
    """logits (BLOCK, EP) float32, -inf for unusable experts -> (weights (BLOCK, EP), total (BLOCK,)): the gates of
    the softmax over each row's TOP_N largest logits (ties to the lower expert) are weights / total; all 0 in a row
    without a usable expert or with a NaN or +inf logit (total 0). exp2 of logits in base-2 units (the caller's
    scale folds in log2 e); on a GPU it compiles to the approximate, flush-to-zero ex2 (a gate below
    2**-126 of the row's largest is 0, where the reference keeps a subnormal), so GPU tests compare scores within
    tolerance, not to the bit."""
    idx = tl.arange(0, EP)[None, :]
    top = tl.max(logits, axis=1)  # the first pick: its logit is the softmax's maximum
    chosen = idx == tl.min(tl.where(logits == top[:, None], idx, EP), axis=1)[:, None]
    for _ in tl.static_range(TOP_N - 1):
        rest = tl.where(chosen, float("-inf"), logits)
        best = tl.max(rest, axis=1)
        chosen = chosen | (idx == tl.min(tl.where(rest == best[:, None], idx, EP), axis=1)[:, None])
    top = tl.where(top > float("-inf"), top, 0.0)  # a row without a usable expert: no -inf - -inf
    weight = tl.where(chosen & (logits > float("-inf")), tl.exp2(logits - top[:, None]), 0.0)
    bad = tl.max(((logits != logits) | (logits == float("inf"))).to(tl.int32), axis=1) > 0  # NaN or +inf: gates 0
    weight = tl.where(bad[:, None], 0.0, weight)
    return weight, tl.sum(weight, axis=1)


@triton.jit
def expert_sims(a, a_scale, experts_hi, experts_lo, unscale_row, BLOCK: tl.constexpr, EP: tl.constexpr):
    """One request's expert-ad similarities over a block: tile a and its scales (None unless int8), the request's
    operands (fused_scan: scaled by powers of two) and unscale (EP,) float32 row -> (BLOCK, EP) float32."""
    return columns_dot(a, a_scale, experts_hi, experts_lo, BLOCK, EP) * tl.load(unscale_row + tl.arange(0, EP))[None, :]


@triton.jit
def mixture(sims, q, q_scale, keys_hi, keys_lo, usable, key_unscale, BLOCK: tl.constexpr, G: tl.constexpr,
            EP: tl.constexpr, TOP_N: tl.constexpr):
    """The gated sum of sims (BLOCK, EP): gating logits from tile q and its scales (None unless int8) against the
    request's keys operands, key_unscale (log2 e over the keys' scale), usable (EP,) bool -> (BLOCK,) float32."""
    if G > 0:
        logits = columns_dot(q, q_scale, keys_hi, keys_lo, BLOCK, EP) * key_unscale
    else:
        logits = tl.zeros((BLOCK, EP), tl.float32)  # the reference's einsum over no dims
    logits = tl.where(usable[None, :], logits, float("-inf"))
    weight, total = expert_gates(logits, TOP_N, EP)
    gates = weight * (1.0 / tl.where(total > 0, total, 1.0))[:, None]  # normalised before the sum, as the reference:
    # a gate that rounds to 0 adds nothing (an inf similarity neither), and no partial sum overflows where the gated one
    # would not; one division per row
    return tl.sum(tl.where(gates > 0, gates * sims, 0.0), axis=1)


@triton.jit
def may_reach(sims, usable, bias, tau):
    """(BLOCK,) bool: False where the row's score could not reach the key tau, whatever its gates. The mixture is a
    convex combination of usable similarities, or 0 when every gate is 0, so it is at most their largest or 0 (a
    chosen NaN similarity makes the score NaN, ranked as -inf: it reaches no tau the bound could skip); less a margin
    far above the rounding of the few operations between that bound and the score, as the CPU pass's entry_bar. A
    NaN bar (a -inf bias against a -inf tau) reaches."""
    bound = tl.maximum(tl.max(tl.where(usable[None, :], sims, float("-inf")), axis=1), 0.0)
    _, score = unpack_keys(tau)
    bar = score - bias - (1e-5 * (tl.abs(score) + tl.abs(bias)) + 1.1754943508222875e-38)
    return ~(bound < bar)


@triton.jit
def pack_keys(score, slot, ok):
    """score (BLOCK,) float32, slot (BLOCK,) int64, ok (BLOCK,) bool -> (BLOCK,) int64 keys whose descending order
    is score descending then slot ascending; NaN ranks as -inf; NO_KEY where not ok."""
    score = tl.where(score != score, float("-inf"), score)
    score = tl.where(score == 0, 0.0, score)  # -0.0 ties with +0.0, as in the reference's sort
    bits = score.to(tl.int32, bitcast=True)
    orderable = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse the magnitude order
    key = (orderable.to(tl.int64) << 32) | (0xFFFFFFFF - slot)
    return tl.where(ok, key, _NO_KEY)


@triton.jit
def unpack_keys(key):
    """(K,) int64 keys -> slots (K,) int64 and scores (K,) float32; -1 and -inf for NO_KEY."""
    high = (key >> 32).to(tl.int32)
    bits = high ^ ((high >> 31) & 0x7FFFFFFF)
    found = key != _NO_KEY
    slot = tl.where(found, 0xFFFFFFFF - (key & 0xFFFFFFFF), -1)
    return slot, tl.where(found, bits.to(tl.float32, bitcast=True), float("-inf"))


@triton.jit(do_not_specialize=UNSPECIALISED["_scan_kernel"])
def _scan_kernel(status_ptr, start_ptr, end_ptr, refs_ptr, vec_ptr, scale_ptr, now_ptr, truth_ptr, experts_hi_ptr,
                 experts_lo_ptr, keys_hi_ptr, keys_lo_ptr, usable_ptr, unscale_ptr, key_unscale_ptr, part_ptr,
                 eligible_ptr, tau_ptr, count_ptr, scored_ptr, n, last, B, W, block_stride, capacity, C: tl.constexpr,
                 STRIDE_R: tl.constexpr, CP: tl.constexpr, STRIDE_V: tl.constexpr, STRIDE_S: tl.constexpr,
                 D: tl.constexpr, DW: tl.constexpr, G: tl.constexpr, G0: tl.constexpr, GW: tl.constexpr,
                 EP: tl.constexpr, TOP_N: tl.constexpr, BIAS_COL: tl.constexpr, BLOCK: tl.constexpr,
                 WIDTH: tl.constexpr, KEEP: tl.constexpr, SKIP: tl.constexpr, MATCHED_ROWS: tl.constexpr):
    """Program i serves block i * block_stride of BLOCK slots for every request b, keeping by KEEP:
    KEEP_TOP its WIDTH best keys at part[b, i] (B, programs, WIDTH) (all BLOCK keys, unsorted, when WIDTH == BLOCK);
    KEEP_MAX its best key at part[b, i] (B, programs); KEEP_ABOVE its keys >= tau[b] appended to part[b]
    (B, capacity) at the positions count[b] (B,) int32 hands out (count still grows past capacity: an overflow);
    KEEP_ABOVE skips the gating and keys of a block without an eligible slot or, with SKIP, where no eligible slot
    may reach tau[b] (may_reach), and counts the blocks it scored in scored (B,) int32. KEEP_TOP and KEEP_ABOVE add the block's eligible counts to eligible (B,).
    The vector rows read are the BLOCK from min(first slot, last) (last: the table's rows - BLOCK), all inside the
    table: the last block reads back over its neighbour's slots and leaves them ineligible; with MATCHED_ROWS only
    the rows of slots some request matches (the block is matched once more first), the others read as 0, which
    no key carries. Tiles: a columns 0 .. DW, q columns G0 .. G0 + GW (float tables: G0 = D; int8: from D's scale
    block on), bias BIAS_COL (< 0: 0)."""
    QUANT: tl.constexpr = vec_ptr.dtype.element_ty == tl.int8
    pid = tl.program_id(0)
    first = (pid * block_stride).to(tl.int64) * BLOCK
    base = tl.minimum(first, last)
    offs = base + tl.arange(0, BLOCK)
    servable, start, end, clause, negate = load_slots(status_ptr, start_ptr, end_ptr, refs_ptr, offs, n, C,
                                                      STRIDE_R, CP)
    servable = servable & (offs >= first)
    rows_ok = None
    if MATCHED_ROWS:  # only the rows some request matches are read
        rows_ok = offs < 0
        for b in range(B):
            rows_ok = rows_ok | match_request(servable, start, end, clause, negate, truth_ptr + b * W,
                                              tl.load(now_ptr + b))
    rows = vec_ptr + base * STRIDE_V
    a = load_tile(rows, 0, 0, D, DW, STRIDE_V, BLOCK, rows_ok)
    q = load_tile(rows, G0, D - G0, D + G - G0, GW, STRIDE_V, BLOCK, rows_ok) if G > 0 else None
    bias = tl.zeros((BLOCK,), tl.float32)
    if BIAS_COL >= 0:
        bias = tl.reshape(load_tile(rows, BIAS_COL, 0, 1, 1, STRIDE_V, BLOCK, rows_ok), (BLOCK,)).to(tl.float32)
    a_scale, q_scale = None, None
    SD: tl.constexpr = DW // _SCALE_BLOCK  # int8: the scale columns of the tiles
    SG: tl.constexpr = GW // _SCALE_BLOCK
    if QUANT:
        scales = scale_ptr + base * STRIDE_S
        a_scale = load_tile(scales, 0, 0, tl.cdiv(D, _SCALE_BLOCK), SD, STRIDE_S, BLOCK, rows_ok)
        if G > 0:
            q_scale = load_tile(scales, G0 // _SCALE_BLOCK, 0, tl.cdiv(D + G, _SCALE_BLOCK) - G0 // _SCALE_BLOCK,
                                SG, STRIDE_S, BLOCK, rows_ok)
        if BIAS_COL >= 0:
            bias *= tl.reshape(load_tile(scales, BIAS_COL // _SCALE_BLOCK, 0, 1, 1, STRIDE_S, BLOCK, rows_ok),
                               (BLOCK,))
    EXPERTS: tl.constexpr = DW * (SD if QUANT else 1) * EP  # elements of a request's operands (fused_scan)
    KEYS: tl.constexpr = GW * (SG if QUANT else 1) * EP
    if KEEP == KEEP_TOP:  # row: where request b's keys go, stepped per request (pointer arithmetic: 64-bit)
        row, step = part_ptr + pid * WIDTH, tl.num_programs(0) * WIDTH
    elif KEEP == KEEP_MAX:
        row, step = part_ptr + pid, tl.num_programs(0)
    else:
        row, step = part_ptr, capacity
    for b in range(B):
        ok = match_request(servable, start, end, clause, negate, truth_ptr + b * W, tl.load(now_ptr + b))
        if KEEP != KEEP_MAX:
            tl.atomic_add(eligible_ptr + b, tl.sum(ok.to(tl.int32)).to(tl.int64))
        sims = expert_sims(a, a_scale, experts_hi_ptr + b * EXPERTS, experts_lo_ptr + b * EXPERTS, unscale_ptr + b * EP,
                           BLOCK, EP)
        usable = tl.load(usable_ptr + b * EP + tl.arange(0, EP)) != 0
        keys_hi, keys_lo, key_unscale = keys_hi_ptr + b * KEYS, keys_lo_ptr + b * KEYS, tl.load(key_unscale_ptr + b)
        if KEEP == KEEP_ABOVE:
            tau = tl.load(tau_ptr + b)
            reach = ok
            if SKIP:
                reach = ok & may_reach(sims, usable, bias, tau)
            if tl.max(reach.to(tl.int32), axis=0) > 0:
                tl.atomic_add(scored_ptr + b, 1)
                score = mixture(sims, q, q_scale, keys_hi, keys_lo, usable, key_unscale, BLOCK, G, EP, TOP_N) + bias
                keys = pack_keys(score, offs, ok)
                above = (keys >= tau) & ok
                kept = tl.sum(above.to(tl.int32))
                if kept > 0:
                    at = tl.atomic_add(count_ptr + b, kept) + tl.cumsum(above.to(tl.int32), axis=0) - 1
                    tl.store(row + at, keys, mask=above & (at < capacity))
        else:
            score = mixture(sims, q, q_scale, keys_hi, keys_lo, usable, key_unscale, BLOCK, G, EP, TOP_N) + bias
            keys = pack_keys(score, offs, ok)
            if KEEP == KEEP_TOP:
                if WIDTH < BLOCK:
                    keys = tl.topk(keys, WIDTH)
                tl.store(row + tl.arange(0, WIDTH), keys)
            else:
                tl.store(row, tl.max(keys, axis=0))
        row += step


@triton.jit(do_not_specialize=UNSPECIALISED["_merge_kernel"])
def _merge_kernel(src_ptr, dst_ptr, slots_ptr, scores_ptr, P, m, W_IN: tl.constexpr, FAN: tl.constexpr,
                  K: tl.constexpr, FINAL: tl.constexpr):
    """Program (i, b): the K best of partials FAN * i .. FAN * (i + 1) of src (B, P, W_IN) for request b -> dst
    (B, programs, K) keys, or in the FINAL round (one program per request) the first m unpacked into slots (B, m)
    and scores (B, m)."""
    i, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = i * FAN + tl.arange(0, FAN)
    cols = tl.arange(0, W_IN)
    tile = tl.load(src_ptr + (b * P + rows[:, None]) * W_IN + cols[None, :], mask=(rows < P)[:, None],
                   other=_NO_KEY)
    best = tl.topk(tl.reshape(tile, (FAN * W_IN,)), K)
    k = tl.arange(0, K)
    if FINAL:
        slot, score = unpack_keys(best)
        tl.store(slots_ptr + b * m + k, slot, mask=k < m)
        tl.store(scores_ptr + b * m + k, score, mask=k < m)
    else:
        tl.store(dst_ptr + (b * tl.num_programs(0) + i) * K + k, best)


def dot_size(k: int) -> int:
    """A tl.dot dimension for k: a power of two, at least 16 (smaller ones compile only in the interpreter)."""
    return max(triton.next_power_of_2(k), 16)


def unpacked(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """unpack_keys in torch: keys (B, m) int64 -> slots (B, m) int64 and scores (B, m) float32; -1 and -inf for
    NO_KEY."""
    high = (keys >> 32).to(torch.int32)
    bits = high ^ ((high >> 31) & 0x7FFFFFFF)
    found = keys != NO_KEY
    return (torch.where(found, 0xFFFFFFFF - (keys & 0xFFFFFFFF), -1),
            torch.where(found, bits.view(torch.float32), float("-inf")))


def merge_fan(width: int, K: int) -> int:
    """Partials of `width` keys a merge program keeping K reads: a tile of MERGE_TILE keys (at least K and two
    partials). Not fewer for fewer partials (masked rows read nothing): the kernel compiles once per width and K,
    not again for each count of partials a pass happens to leave."""
    return max(MERGE_TILE // width, K // width, 2)


def merge_partials(partial: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """partial (B, P, w) int64 keys -> the m best per request: slots (B, m) int64 (-1 padded), scores (B, m)
    float32 (-inf padded), by score descending then slot ascending."""
    partial = partial.contiguous()  # the merge kernel reads it row by row
    B = partial.shape[0]
    K = top_width(m)
    if K > MERGE_MAX_K:  # keys are distinct but NO_KEY, whose places unpack alike: topk's order among equals is moot
        keys = partial.reshape(B, -1)
        best = keys.topk(min(m, keys.shape[1]), dim=1).values
        return unpacked(torch.nn.functional.pad(best, (0, m - best.shape[1]), value=NO_KEY))
    slots = torch.empty((B, m), dtype=torch.int64, device=partial.device)
    scores = torch.empty((B, m), dtype=torch.float32, device=partial.device)
    while True:
        P, width = partial.shape[1:]
        fan = merge_fan(width, K)
        programs = triton.cdiv(P, fan)
        final = programs == 1
        out = partial if final else partial.new_empty((B, programs, K))
        _merge_kernel[(programs, B)](partial, out, slots, scores, P, m, W_IN=width, FAN=fan, K=K, FINAL=final)
        if final:
            return slots, scores
        partial = out


def table_rows(t: torch.Tensor) -> torch.Tensor:
    """A table (n, S) -> the same with unit column stride and at least BLOCK rows (zero rows appended), so that a
    scan program reads whole blocks of rows inside it."""
    t = t if t.stride(1) == 1 else t.contiguous()
    return t if t.shape[0] >= BLOCK else torch.cat([t, t.new_zeros((BLOCK - t.shape[0], t.shape[1]))])


def mma_operand(w: np.ndarray, lead: int, window: int, ep: int, table: torch.dtype,
                per_row: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Request-side weights w (B, E, K) float64, one per table column of a tile that starts lead columns before the
    first (and is window columns wide) -> columns_dot's operand, (hi, lo) (B, window, NS * ep): row lead + j holds
    w[:, :, j] in column block 0 (NS = 1), or for int8 tables (NS = window / SCALE_BLOCK; the tile starts at a scale
    block) in column block (lead + j) // SCALE_BLOCK; and the factor that undoes the scaling, (B, ep) float32 when
    per_row else (B,). Each request's weights (each expert's when per_row) are scaled by a power of two (exact) that
    brings their largest magnitude into [2^14, 2^15): hi, their float16 rounding, cannot overflow, and lo =
    float16(w - hi) keeps w to about 2^-22 of that magnitude (float16's subnormals start 29 binades below it; smaller
    weights lose digits, but only beneath that). float32 tables take hi = the scaled weights as float32 (lo unread).
    In numpy on the host: a few dozen operations on arrays this small cost microseconds there, tens as torch ops."""
    B, E, K = w.shape
    peak = np.abs(w).max(axis=2 if per_row else (1, 2), keepdims=True)
    k = np.clip(15 - np.frexp(peak)[1], -100, 100)  # frexp: peak < 2^exponent
    w = np.ldexp(w, k)
    ns = window // SCALE_BLOCK if table == torch.int8 else 1
    operand = np.zeros((B, window, ns, ep))
    rows = np.arange(K) + lead
    operand[:, rows, rows // SCALE_BLOCK if ns > 1 else 0, :E] = w.transpose(0, 2, 1)
    operand = operand.reshape(B, window, ns * ep)
    unscale = np.ldexp(np.float32(1.0), -k).astype(np.float32)
    if per_row:
        unscale, per_expert = np.ones((B, ep), np.float32), unscale
        unscale[:, :E] = per_expert.reshape(B, E)
    else:
        unscale = unscale.reshape(B)
    if table == torch.float32:
        hi = operand.astype(np.float32)
        return hi, hi, unscale
    with np.errstate(over="ignore"):  # past 2^115 (k's clamp) a weight goes to inf, as it always did
        hi = operand.astype(np.float16)
        return hi, (operand - hi).astype(np.float16), unscale


def request_operands(experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, D: int, G0: int, DW: int, GW: int,
                     EP: int, table: torch.dtype) -> tuple[np.ndarray, ...]:
    """The scan kernel's request side, made on the host (a few dozen small operations that would each be a launch on
    the GPU): (experts hi, experts lo, keys hi, keys lo, usable (B, EP) int8, unscale (B, EP), key unscale (B,) in
    log2 units for the gates' exp2)."""
    B, E, G = experts.shape[0], experts.shape[1], keys.shape[2]
    host = torch.cat([experts.flatten().float(), keys.flatten().float(), mask.flatten().float()]).cpu()  # one sync
    experts, keys, mask = np.split(host.numpy().astype(np.float64), [experts.numel(), experts.numel() + keys.numel()])
    experts, keys, mask = experts.reshape(B, E, -1), keys.reshape(B, E, G), mask.reshape(B, E) > 0
    experts_hi, experts_lo, unscale = mma_operand(experts, 0, DW, EP, table, per_row=True)
    if G:
        keys_hi, keys_lo, key_unscale = mma_operand(keys, D - G0, GW, EP, table, per_row=False)
    else:  # unread (an empty tensor is no valid pointer)
        keys_hi, keys_lo, key_unscale = experts_hi, experts_lo, unscale[:, 0]
    usable = np.zeros((B, EP), dtype=np.int8)
    usable[:, :E] = mask
    return experts_hi, experts_lo, keys_hi, keys_lo, usable, unscale, key_unscale * np.float32(math.log2(math.e))


def operand_layout(D: int, G: int, E: int, table: torch.dtype) -> tuple[int, int, int, int]:
    """(EP, G0, DW, GW): the dots' N (experts padded to a power of two, at least a tensor core's least: smaller ones
    Triton pads, in more registers; for sm_90 the dot product, E = 1, took 142 at N = 1, 110 at N = 8), the column
    where q's tile starts (int8: at its first scale block) and the two tiles' widths."""
    G0 = D - D % SCALE_BLOCK if table == torch.int8 else D
    return max(triton.next_power_of_2(E), 8), G0, dot_size(D), dot_size(D + G - G0)


def request_side(experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, table: torch.dtype,
                 device: torch.device) -> tuple[tuple[int, int, int, int], tuple[torch.Tensor, ...]]:
    """The operand layout (operand_layout) and the scan kernel's request operands (request_operands), on device, for
    a table of this dtype."""
    D = experts.shape[2]
    EP, G0, DW, GW = layout = operand_layout(D, keys.shape[2], experts.shape[1], table)
    return layout, upload(request_operands(experts, keys, mask, D, G0, DW, GW, EP, table), device)


def upload(arrays: tuple[np.ndarray, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Host arrays -> the same as tensors on device in one copy: packed into one byte buffer, each at a 128-byte
    boundary (so that the kernels see aligned pointers), then viewed back."""
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    starts, at = [], 0
    for a in arrays:
        starts.append(at)
        at += -(-a.nbytes // 128) * 128
    host = torch.zeros(at, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    packed = host.numpy()
    for start, a in zip(starts, arrays):
        packed[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return tuple(on_device[start:start + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
                 for start, a in zip(starts, arrays))


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int, sample_stride: int | None = None, stats: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass: match, score, top-m -> (slots (B, m) int64, scores (B, m) float32, eligible (B,) int64);
    shapes and meaning as kernels.reference.fused.fused_scan. sample_stride: the threshold scan's, SAMPLE_STRIDE when
    None (read at the call, so that tests may set it), 0 to skip that scan. stats, a
    dict, receives what the pass did: "blocks" (of BLOCK slots), "path" ("threshold" or "per-block") and, after the
    threshold scan, "scored" (B,) the blocks whose gating it computed for each request (the rest it skipped)."""
    B, n = now.shape[0], status.shape[0]
    E, D, G = experts.shape[1], experts.shape[2], keys.shape[2]
    table = (status, start, end, refs, vectors, scales)
    refs = refs_with_a_column(refs)
    quant = vectors.dtype == torch.int8
    vectors = table_rows(vectors)
    scales = table_rows(scales.float()) if quant else vectors  # unread unless quantised
    (EP, G0, DW, GW), operands = request_side(experts, keys, mask, vectors.dtype, status.device)
    inputs = (status.contiguous(), start.contiguous(), end.contiguous(), refs, vectors, scales,
              now.to(torch.int64).contiguous(), truth.to(torch.int32).contiguous(), *operands)
    eligible = torch.zeros(B, dtype=torch.int64, device=status.device)
    blocks = max(triton.cdiv(n, BLOCK), 1)

    def scan(programs, part, keep, width=1, tau=eligible, count=eligible, scored=eligible, stride=1, capacity=0):
        _scan_kernel[(programs,)](
            *inputs, part, eligible, tau, count, scored, n, vectors.shape[0] - BLOCK, B, truth.shape[1], stride, capacity,
            C=refs.shape[1], STRIDE_R=refs.stride(0), CP=triton.next_power_of_2(refs.shape[1]),
            STRIDE_V=vectors.stride(0), STRIDE_S=scales.stride(0), D=D, DW=DW, G=G, G0=G0, GW=GW, EP=EP,
            TOP_N=min(top_n, E), BIAS_COL=bias_col, BLOCK=BLOCK, WIDTH=width, KEEP=keep, SKIP=SKIP_BELOW_TAU,
            MATCHED_ROWS=B <= MATCHED_ROWS_MAX_B, num_warps=SCAN_WARPS)

    sample_stride = SAMPLE_STRIDE if sample_stride is None else sample_stride
    sampled = blocks // sample_stride if sample_stride else 0
    if sampled >= m:
        best = torch.empty((B, sampled), dtype=torch.int64, device=status.device)
        scan(sampled, best, KEEP_MAX, stride=sample_stride)
        # tau in a buffer of its own and count's and scored's rows 128 bytes apart: Triton compiles a kernel per
        # pointer alignment (16 bytes or not), so views at offsets that vary with B or m would compile anew mid-traffic
        tau = best.topk(m, dim=1).values[:, -1].clone(memory_format=torch.contiguous_format)
        capacity = triton.cdiv(max(CANDIDATES * m, MIN_CANDIDATES), BLOCK) * BLOCK
        candidates = torch.full((B, capacity), NO_KEY, dtype=torch.int64, device=status.device)
        count, scored = torch.zeros((2, triton.cdiv(B, 32) * 32), dtype=torch.int32, device=status.device)[:, :B]
        scan(blocks, candidates, KEEP_ABOVE, tau=tau, count=count, scored=scored, capacity=capacity)
        used, kept = torch.stack([count.max(), (count >= eligible.clamp(max=m)).all()]).tolist()  # one sync
        if used <= capacity and kept:  # every request kept its m
            used = triton.cdiv(max(used, 1), BLOCK) * BLOCK
            if stats is not None:
                stats.update(blocks=blocks, path="threshold", scored=scored)
            return (*merge_partials(candidates[:, :used].reshape(B, used // BLOCK, BLOCK), m), eligible)
        eligible.zero_()
    if stats is not None:
        stats.update(blocks=blocks, path="per-block")
        stats.pop("scored", None)
    width = min(top_width(m), BLOCK)
    part = max(1, PER_BLOCK_BYTES // (blocks * width * 8))
    if B > part:
        return in_parts(lambda *side: fused_scan(*table, *side, bias_col, top_n, m, 0, stats),
                        (now, truth, experts, keys, mask), part)
    partial = torch.empty((B, blocks, width), dtype=torch.int64, device=status.device)
    scan(blocks, partial, KEEP_TOP, width)
    slots, scores = merge_partials(partial, m)
    return slots, scores, eligible


def warm_up(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor, vectors: torch.Tensor,
            scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor, experts: torch.Tensor,
            keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int) -> None:
    """Compile every kernel a pass over this table with this head may launch (Triton compiles on a kernel's first
    launch, seconds, while requests wait): for each power of two a shortlist rounds up to (the only compile-time
    shape requests change; above MERGE_MAX_K torch merges), the threshold scan (also over a table too small to take
    it yet) and the per-block one (taken when candidates overflow), and the merge of every round (one round, and a
    first, a middle and a last), each scan for a batch of one request and one of MATCHED_ROWS_MAX_B + 1 (the
    first request repeated: the two ways of loading rows)."""
    if status.shape[0] == 0:  # passes skip an empty table: its first ads' first pass compiles
        return
    table = (status, start, end, refs, vectors, scales)
    rows = SAMPLE_STRIDE * BLOCK  # the fewest slots the threshold scan is taken over (at m = 1)
    grown = [None if t is None else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
             for t in table] if status.shape[0] < rows else None  # slots of no ad (unservable) past a table too
    # small for the threshold scan
    shortlists = [2**j for j in range(max(MERGE_MAX_K, BLOCK).bit_length())]
    for B in {1, MATCHED_ROWS_MAX_B + 1}:
        head = (*(r[:1].repeat(B, *[1] * (r.dim() - 1)) for r in (now, truth, experts, keys, mask)), bias_col, top_n)
        if grown is not None:  # the threshold scan, not over this table, so over the grown one
            fused_scan(*grown, *head, 1)
        for K in shortlists:
            path: dict = {}
            fused_scan(*table, *head, K, stats=path)
            if path["path"] == "threshold":
                fused_scan(*table, *head, K, sample_stride=0)
    for K in shortlists:
        for width in {min(K, BLOCK), BLOCK}:
            for P in (1, merge_fan(width, K) * merge_fan(K, K) + 1):
                merge_partials(torch.full((1, P, width), NO_KEY, dtype=torch.int64, device=status.device), K)
