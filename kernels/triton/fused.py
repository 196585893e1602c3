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

A key orders (score descending, slot ascending) as one int64 descending: the high 32 bits hold the score's float
bits made orderable as a signed integer, the low 32 bits 0xFFFFFFFF - slot. Ineligible slots hold NO_KEY.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.fused import SCALE_BLOCK
from kernels.triton.match import load_slots, match_request, refs_with_a_column

BLOCK = 128  # slots per program
SCAN_WARPS = {False: 4, True: 8}  # by int8 storage: on an H200 4 warps scanned fp16 1.6x faster than 8 (10M ads,
# B = 16); int8's dequantisation needs 8 (at 4 ptxas spills), so each keeps its registers (checked ahead for sm_90)
SAMPLE_STRIDE = 16  # the threshold scan reads every 16th block
CANDIDATES = 64  # candidate keys kept per request: CANDIDATES * m (at least MIN_CANDIDATES) before the exact fallback
MIN_CANDIDATES = 8192
KEEP_TOP, KEEP_MAX, KEEP_ABOVE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # what a block keeps: its top WIDTH keys, its best key, the keys >= tau
MERGE_TILE = 2048  # keys a merge program selects from (more when m needs it)
NO_KEY = -2**63

_NO_KEY = tl.constexpr(NO_KEY)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


@triton.jit
def load_columns(vec_ptr, scale_ptr, offs, valid, col0, stride_v0, stride_v1, stride_s0, stride_s1,
                 NCOL: tl.constexpr, NP: tl.constexpr, QUANT: tl.constexpr):
    """Columns col0 .. col0 + NCOL of the slots offs (BLOCK,) -> (BLOCK, NP) float32, 0 past NCOL and where not
    valid; int8 (QUANT) is dequantised with the scale of its block of SCALE_BLOCK dims."""
    j = tl.arange(0, NP)
    cols = col0 + j
    inside = valid[:, None] & (j < NCOL)[None, :]
    x = tl.load(vec_ptr + offs[:, None] * stride_v0 + cols[None, :] * stride_v1, mask=inside, other=0)
    x = x.to(tl.float32)
    if QUANT:
        x = x * tl.load(scale_ptr + offs[:, None] * stride_s0 + (cols // _SCALE_BLOCK)[None, :] * stride_s1,
                        mask=inside, other=0)
    return x


@triton.jit
def expert_gates(logits, TOP_N: tl.constexpr, EP: tl.constexpr):
    """logits (BLOCK, EP) float32, -inf for unusable experts -> gates (BLOCK, EP): the softmax over each row's
    TOP_N largest logits (ties to the lower expert), 0 elsewhere; all 0 in a row without a usable expert."""
    idx = tl.arange(0, EP)[None, :]
    chosen = tl.zeros(logits.shape, tl.int1)
    for _ in tl.static_range(TOP_N):
        rest = tl.where(chosen, float("-inf"), logits)
        best = tl.max(rest, axis=1)
        first = tl.min(tl.where(rest == best[:, None], idx, EP), axis=1)
        chosen = chosen | (idx == first[:, None])
    usable = chosen & (logits > float("-inf"))
    top = tl.max(tl.where(usable, logits, float("-inf")), axis=1)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row without a usable expert: no -inf - -inf
    weight = tl.where(usable, tl.exp(logits - top[:, None]), 0.0)
    total = tl.sum(weight, axis=1)
    return weight / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def head_scores(a, q, bias, experts_row, keys_row, mask_row, BLOCK: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                TOP_N: tl.constexpr):
    """One request's head over a block: a (BLOCK, DP), q (BLOCK, GP), bias (BLOCK,) float32 with the request's
    experts (E, D), keys (E, G) float32 and mask (E,) int8 rows -> (BLOCK,) float32 scores. DP, GP, EP >= 16 (tl.dot);
    tf32x3 keeps float32 accuracy on tensor cores."""
    e = tl.arange(0, EP)
    d = tl.arange(0, DP)
    experts = tl.load(experts_row + e[None, :] * D + d[:, None], mask=(e < E)[None, :] & (d < D)[:, None], other=0)
    sims = tl.dot(a, experts, input_precision="tf32x3")  # (BLOCK, EP)
    if G > 0:
        g = tl.arange(0, GP)
        keys = tl.load(keys_row + e[None, :] * G + g[:, None], mask=(e < E)[None, :] & (g < G)[:, None], other=0)
        logits = tl.dot(q, keys, input_precision="tf32x3")
    else:
        logits = tl.zeros((BLOCK, EP), tl.float32)  # the reference's einsum over no dims
    usable = tl.load(mask_row + e, mask=e < E, other=0) != 0
    logits = tl.where(usable[None, :], logits, float("-inf"))
    return tl.sum(expert_gates(logits, TOP_N, EP) * sims, axis=1) + bias


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


@triton.jit
def _scan_kernel(status_ptr, start_ptr, end_ptr, refs_ptr, vec_ptr, scale_ptr, now_ptr, truth_ptr, experts_ptr,
                 keys_ptr, mask_ptr, part_ptr, eligible_ptr, tau_ptr, count_ptr, n, B, W, C, bias_col, stride_r0,
                 stride_r1, stride_v0, stride_v1, stride_s0, stride_s1, block_stride, capacity, CP: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, E: tl.constexpr,
                 EP: tl.constexpr, TOP_N: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr,
                 BLOCK: tl.constexpr, WIDTH: tl.constexpr, KEEP: tl.constexpr):
    """Program i reads block i * block_stride of BLOCK slots and serves every request b, keeping by KEEP:
    KEEP_TOP its WIDTH best keys at part[b, i] (B, programs, WIDTH) (all BLOCK keys, unsorted, when WIDTH == BLOCK);
    KEEP_MAX its best key at part[b, i] (B, programs); KEEP_ABOVE its keys >= tau[b] appended to part[b]
    (B, capacity) at the positions count[b] (B,) int32 hands out (count still grows past capacity: an overflow).
    KEEP_TOP and KEEP_ABOVE add the block's eligible counts to eligible (B,)."""
    pid = tl.program_id(0)
    offs = (pid * block_stride).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    servable, start, end, clause, negate = load_slots(status_ptr, start_ptr, end_ptr, refs_ptr, offs, n, C,
                                                      stride_r0, stride_r1, CP)
    a = load_columns(vec_ptr, scale_ptr, offs, valid, 0, stride_v0, stride_v1, stride_s0, stride_s1, D, DP, QUANT)
    q = load_columns(vec_ptr, scale_ptr, offs, valid, D, stride_v0, stride_v1, stride_s0, stride_s1, G, GP, QUANT)
    bias = tl.sum(load_columns(vec_ptr, scale_ptr, offs, valid, bias_col, stride_v0, stride_v1, stride_s0,
                               stride_s1, HAS_BIAS, 1, QUANT), axis=1)
    if KEEP == KEEP_TOP:  # row: where request b's keys go, stepped per request (pointer arithmetic: 64-bit)
        row, step = part_ptr + pid * WIDTH, tl.num_programs(0) * WIDTH
    elif KEEP == KEEP_MAX:
        row, step = part_ptr + pid, tl.num_programs(0)
    else:
        row, step = part_ptr, capacity
    for b in range(B):
        ok = match_request(servable, start, end, clause, negate, truth_ptr + b * W, tl.load(now_ptr + b))
        if KEEP != KEEP_MAX:
            tl.atomic_add(eligible_ptr + b, tl.sum(ok.to(tl.int64)))
        score = head_scores(a, q, bias, experts_ptr + b * E * D, keys_ptr + b * E * G, mask_ptr + b * E,
                            BLOCK, D, DP, G, GP, E, EP, TOP_N)
        keys = pack_keys(score, offs, ok)
        if KEEP == KEEP_TOP:
            if WIDTH < BLOCK:
                keys = tl.topk(keys, WIDTH)
            tl.store(row + tl.arange(0, WIDTH), keys)
        elif KEEP == KEEP_MAX:
            tl.store(row, tl.max(keys, axis=0))
        else:
            above = (keys >= tl.load(tau_ptr + b)) & ok
            kept = tl.sum(above.to(tl.int32))
            if kept > 0:
                at = tl.atomic_add(count_ptr + b, kept) + tl.cumsum(above.to(tl.int32), axis=0) - 1
                tl.store(row + at, keys, mask=above & (at < capacity))
        row += step


@triton.jit
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


def merge_partials(partial: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """partial (B, P, w) int64 keys -> the m best per request: slots (B, m) int64 (-1 padded), scores (B, m)
    float32 (-inf padded), by score descending then slot ascending."""
    partial = partial.contiguous()  # the merge kernel reads it row by row
    B = partial.shape[0]
    K = triton.next_power_of_2(max(m, 1))
    slots = torch.empty((B, m), dtype=torch.int64, device=partial.device)
    scores = torch.empty((B, m), dtype=torch.float32, device=partial.device)
    while True:
        P, width = partial.shape[1:]
        fan = max(min(triton.next_power_of_2(P), max(MERGE_TILE // width, 2)), K // width)
        programs = triton.cdiv(P, fan)
        final = programs == 1
        out = partial if final else partial.new_empty((B, programs, K))
        _merge_kernel[(programs, B)](partial, out, slots, scores, P, m, W_IN=width, FAN=fan, K=K, FINAL=final)
        if final:
            return slots, scores
        partial = out


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int, sample_stride: int = SAMPLE_STRIDE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass: match, score, top-m -> (slots (B, m) int64, scores (B, m) float32, eligible (B,) int64);
    shapes and meaning as kernels.reference.fused.fused_scan. sample_stride 0 skips the threshold scan."""
    B, n = now.shape[0], status.shape[0]
    E, D, G = experts.shape[1], experts.shape[2], keys.shape[2]
    refs = refs_with_a_column(refs)
    quant = vectors.dtype == torch.int8
    scales = scales.float() if quant else vectors  # unread unless quantised
    experts = experts.float().contiguous()
    keys = keys.float().contiguous() if G else experts  # unread when G == 0 (an empty tensor is no valid pointer)
    inputs = (status.contiguous(), start.contiguous(), end.contiguous(), refs, vectors, scales,
              now.to(torch.int64).contiguous(), truth.to(torch.int32).contiguous(), experts, keys,
              mask.to(torch.int8).contiguous())
    eligible = torch.zeros(B, dtype=torch.int64, device=status.device)
    blocks = max(triton.cdiv(n, BLOCK), 1)

    def scan(programs, part, keep, width=1, tau=eligible, count=eligible, stride=1, capacity=0):
        _scan_kernel[(programs,)](
            *inputs, part, eligible, tau, count, n, B, truth.shape[1], refs.shape[1], max(bias_col, 0),
            refs.stride(0), refs.stride(1), vectors.stride(0), vectors.stride(1), scales.stride(0), scales.stride(1),
            stride, capacity, CP=triton.next_power_of_2(refs.shape[1]), D=D, DP=dot_size(D), G=G, GP=dot_size(G),
            E=E, EP=dot_size(E), TOP_N=min(top_n, E), HAS_BIAS=int(bias_col >= 0), QUANT=quant, BLOCK=BLOCK,
            WIDTH=width, KEEP=keep, num_warps=SCAN_WARPS[quant])

    sampled = blocks // sample_stride if sample_stride else 0
    if sampled >= m:
        best = torch.empty((B, sampled), dtype=torch.int64, device=status.device)
        scan(sampled, best, KEEP_MAX, stride=sample_stride)
        tau = best.topk(m, dim=1).values[:, -1].contiguous()
        capacity = triton.cdiv(max(CANDIDATES * m, MIN_CANDIDATES), BLOCK) * BLOCK
        candidates = torch.full((B, capacity), NO_KEY, dtype=torch.int64, device=status.device)
        count = torch.zeros(B, dtype=torch.int32, device=status.device)
        scan(blocks, candidates, KEEP_ABOVE, tau=tau, count=count, capacity=capacity)
        used = int(count.max())
        if used <= capacity:
            used = triton.cdiv(max(used, 1), BLOCK) * BLOCK
            return (*merge_partials(candidates[:, :used].reshape(B, used // BLOCK, BLOCK), m), eligible)
        eligible.zero_()
    width = min(triton.next_power_of_2(max(m, 1)), BLOCK)
    partial = torch.empty((B, blocks, width), dtype=torch.int64, device=status.device)
    scan(blocks, partial, KEEP_TOP, width)
    slots, scores = merge_partials(partial, m)
    return slots, scores, eligible
