"""The fused pass on the CPU, compiled with numba: same inputs and result as kernels.reference.fused.

The slots are cut into ranges, one per task, run on all cores. A task reads each ad's status, window and
refs once and tests them for every request of the batch; only when some request matches does it decode
the ad's vector (int8 with block scales, fp16 bits or fp32) into a small buffer, and only then score it:
the gating logits of the usable experts, the top-n, their softmax and the similarities of the chosen
experts alone. Each task keeps, per request, a bounded heap of its m best (score, slot); the heaps of the
tasks are merged at the end. Nothing of the table's size is allocated.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from kernels.reference.fused import SCALE_BLOCK

SERVABLE = 7
FLAGS = {"contract", "arcp", "reassoc"}  # fast float math that still keeps NaN and inf semantics
TASKS_PER_THREAD = 4
BLOCK = 64  # ads a task matches, decodes and scores together (their decoded vectors stay in L1)


def _half_table() -> np.ndarray:
    """(65536,) float32: the value of every IEEE half bit pattern (fp16 rows decode by lookup)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


HALF = _half_table()


@njit(inline="always", error_model="numpy")
def _matches(status, start, end, refs, truth, now, i, b) -> bool:
    if status[i] & SERVABLE != SERVABLE or not (start[i] <= now[b] < end[i]):
        return False
    for c in range(refs.shape[1]):
        ref = refs[i, c]
        clause = ref >> 1
        if ((truth[b, clause >> 5] >> (clause & 31)) & 1) == (ref & 1):
            return False
    return True


@njit(inline="always", error_model="numpy")
def _better(score_a, slot_a, score_b, slot_b) -> bool:
    return score_a > score_b or (score_a == score_b and slot_a < slot_b)


@njit(inline="always", error_model="numpy")
def _push(heap_score, heap_slot, size, score, slot) -> int:
    """Offer (score, slot) to a min-heap (root = worst) of capacity len(heap_score); returns its new size."""
    m = heap_score.shape[0]
    if size < m:
        j = size
        heap_score[j], heap_slot[j] = score, slot
        while j > 0:  # sift up
            parent = (j - 1) >> 1
            if not _better(heap_score[parent], heap_slot[parent], heap_score[j], heap_slot[j]):
                break
            heap_score[j], heap_score[parent] = heap_score[parent], heap_score[j]
            heap_slot[j], heap_slot[parent] = heap_slot[parent], heap_slot[j]
            j = parent
        return size + 1
    if not _better(score, slot, heap_score[0], heap_slot[0]):
        return size
    heap_score[0], heap_slot[0] = score, slot
    j = 0
    while True:  # sift down
        worst, left, right = j, 2 * j + 1, 2 * j + 2
        if left < m and _better(heap_score[worst], heap_slot[worst], heap_score[left], heap_slot[left]):
            worst = left
        if right < m and _better(heap_score[worst], heap_slot[worst], heap_score[right], heap_slot[right]):
            worst = right
        if worst == j:
            return size
        heap_score[j], heap_score[worst] = heap_score[worst], heap_score[j]
        heap_slot[j], heap_slot[worst] = heap_slot[worst], heap_slot[j]
        j = worst


def _decode(vectors, scales, rows, cnt, width, bias_col, xt, bias) -> None:
    """The first `width` dims of the cnt ads at `rows`, as float32, into the columns of xt (width, BLOCK), and
    their biases into bias (0 when bias_col < 0). Compiled per storage: int8 with one scale per SCALE_BLOCK
    dims, fp16 as its int16 bits, fp32. The ads are the inner loop: stores along a row of xt."""


@overload(_decode, inline="always")
def _decode_for(vectors, scales, rows, cnt, width, bias_col, xt, bias):
    if vectors.dtype == types.int8:
        def value(vectors, scales, i, d):
            return vectors[i, d] * scales[i, d // SCALE_BLOCK]
    elif vectors.dtype == types.int16:
        def value(vectors, scales, i, d):
            return HALF[vectors[i, d] & 0xFFFF]
    else:
        def value(vectors, scales, i, d):
            return np.float32(vectors[i, d])
    value = njit(inline="always", error_model="numpy")(value)

    def decode(vectors, scales, rows, cnt, width, bias_col, xt, bias):
        for d in range(width):
            row = xt[d]
            for c in range(cnt):
                row[c] = value(vectors, scales, rows[c], d)
        for c in range(cnt):
            bias[c] = value(vectors, scales, rows[c], bias_col) if bias_col >= 0 else np.float32(0.0)
    return decode


@njit(inline="always", error_model="numpy")
def _products(xt, start, users, b, out) -> None:
    """out[e, :] = users[b, e] . xt[start:start + len, :] for every expert e: one dot per ad of the block,
    the ads in the inner loop of fixed length BLOCK so that it runs in SIMD lanes (columns past the block's
    ads hold leftovers, never read)."""
    for e in range(users.shape[1]):
        acc = out[e]
        for c in range(BLOCK):
            acc[c] = 0.0
        for d in range(users.shape[2]):
            u, column = users[b, e, d], xt[start + d]
            for c in range(BLOCK):
                acc[c] += u * column[c]


@njit(parallel=True, fastmath=FLAGS, error_model="numpy", cache=True)
def _fused(status, start, end, refs, vectors, scales, now, truth, experts, keys, mask, bias_col, top_n, m, tasks):
    """Per task and request its m best (scores (T, B, m), slots (T, B, m); -inf / -1 padded), and the
    eligible counts (T, B). Each task walks its slots in blocks of BLOCK: it matches the block for every
    request, decodes the ads some request matches into a transposed buffer, computes the gating logits and
    expert similarities of the block per request, then scores and offers each eligible pair to its heap."""
    n, B, E, D = status.shape[0], now.shape[0], experts.shape[1], experts.shape[2]
    width = D + keys.shape[2]
    out_score = np.full((tasks, B, m), -np.inf, dtype=np.float32)
    out_slot = np.full((tasks, B, m), -1, dtype=np.int64)
    counts = np.zeros((tasks, B), dtype=np.int64)
    per = (n + tasks - 1) // tasks
    for t in prange(tasks):
        xt = np.zeros((width, BLOCK), dtype=np.float32)
        bias = np.empty(BLOCK, dtype=np.float32)
        rows = np.empty(BLOCK, dtype=np.int64)
        ok = np.empty((B, BLOCK), dtype=np.bool_)
        logit, sim = np.empty((E, BLOCK), dtype=np.float32), np.empty((E, BLOCK), dtype=np.float32)
        picked, picked_logit = np.empty(E, dtype=np.int64), np.empty(E, dtype=np.float32)
        sizes, eligible = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)  # the task's own: no false sharing
        for block in range(t * per, min(n, (t + 1) * per), BLOCK):
            cnt = 0
            for i in range(block, min(n, (t + 1) * per, block + BLOCK)):
                some = False
                for b in range(B):
                    ok[b, cnt] = _matches(status, start, end, refs, truth, now, i, b)
                    some |= ok[b, cnt]
                if some:  # the vector's bytes are read only for an ad some request matches
                    rows[cnt] = i
                    cnt += 1
            if cnt == 0:
                continue
            _decode(vectors, scales, rows, cnt, width, bias_col, xt, bias)
            for b in range(B):
                _products(xt, D, keys, b, logit)
                _products(xt, 0, experts, b, sim)
                for c in range(cnt):
                    if ok[b, c]:
                        eligible[b] += 1
                        score = _gated(logit, sim, mask, b, c, top_n, picked, picked_logit) + bias[c]
                        if score != score:  # NaN ranks as -inf
                            score = -np.inf
                        if sizes[b] < m or _better(score, rows[c], out_score[t, b, 0], out_slot[t, b, 0]):
                            sizes[b] = _push(out_score[t, b], out_slot[t, b], sizes[b], score, rows[c])
        counts[t] = eligible
    return out_score, out_slot, counts


@njit(inline="always", error_model="numpy")
def _gated(logit, sim, mask, b, c, top_n, picked, picked_logit) -> np.float32:
    """The gated sum of similarities of ad c of the block for request b: softmax over the top-n usable
    experts by logit (of equal logits, the lower expert); 0 with no usable expert."""
    n = 0
    for e in range(logit.shape[0]):  # one pass, inserting into the sorted top-n so far
        if not mask[b, e]:
            continue
        value = logit[e, c]
        j = min(n, top_n - 1) if n == top_n else n
        if n == top_n and not value > picked_logit[j]:
            continue
        while j > 0 and value > picked_logit[j - 1]:
            picked[j], picked_logit[j] = picked[j - 1], picked_logit[j - 1]
            j -= 1
        picked[j], picked_logit[j] = e, value
        n = min(n + 1, top_n)
    if n == 0:
        return np.float32(0.0)
    total, score = np.float32(1.0), sim[picked[0], c]
    for j in range(1, n):
        weight = np.float32(math.exp(picked_logit[j] - picked_logit[0]))
        total += weight
        score += weight * sim[picked[j], c]
    return score / total


@njit(parallel=True, error_model="numpy", cache=True)
def _match(status, start, end, refs, truth, now):
    n, B = status.shape[0], now.shape[0]
    out = np.zeros((B, n), dtype=np.bool_)
    for i in prange(n):
        for b in range(B):
            out[b, i] = _matches(status, start, end, refs, truth, now, i, b)
    return out


def _arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.contiguous().numpy() for t in tensors]


def merge_partials(scores: torch.Tensor, slots: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-task partial results (T, B, m) -> the m best per request (slots (B, m), scores (B, m)) by score
    descending, then slot ascending; empty places (slot -1) last."""
    T, B, _ = scores.shape
    scores, slots = scores.permute(1, 0, 2).reshape(B, -1), slots.permute(1, 0, 2).reshape(B, -1)
    by_slot = torch.argsort(torch.where(slots < 0, torch.iinfo(torch.int64).max, slots), dim=1, stable=True)
    scores, slots = scores.gather(1, by_slot), slots.gather(1, by_slot)
    by_score = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :m]
    return slots.gather(1, by_score), scores.gather(1, by_score)


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.reference.fused.fused_scan, compiled for the CPU (CPU tensors in and out)."""
    stored = vectors.view(torch.int16) if vectors.dtype == torch.float16 else vectors
    scales = scales if scales is not None else torch.ones((1, 1))
    tasks = max(1, min(numba.get_num_threads() * TASKS_PER_THREAD, status.shape[0]))
    out_score, out_slot, counts = _fused(*_arrays(status, start, end, refs, stored, scales.float()),
                                         *_arrays(now, truth, experts.float(), keys.float(), mask),
                                         bias_col, top_n, m, tasks)
    slots, scores = merge_partials(torch.from_numpy(out_score), torch.from_numpy(out_slot), m)
    return slots, scores, torch.from_numpy(counts).sum(0)


def clause_match(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                 truth: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """kernels.reference.fused.clause_match, compiled for the CPU."""
    return torch.from_numpy(_match(*_arrays(status, start, end, refs, truth, now)))
