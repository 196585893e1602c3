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


def _half_table() -> np.ndarray:
    """(65536,) float32: the value of every IEEE half bit pattern (fp16 rows decode by lookup)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


HALF = _half_table()


@njit(inline="always")
def _matches(status, start, end, refs, truth, now, i, b) -> bool:
    if status[i] & SERVABLE != SERVABLE or not (start[i] <= now[b] < end[i]):
        return False
    for c in range(refs.shape[1]):
        ref = refs[i, c]
        clause = ref >> 1
        if ((truth[b, clause >> 5] >> (clause & 31)) & 1) == (ref & 1):
            return False
    return True


@njit(inline="always")
def _better(score_a, slot_a, score_b, slot_b) -> bool:
    return score_a > score_b or (score_a == score_b and slot_a < slot_b)


@njit(inline="always")
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


def _decode(vectors, scales, i, width, bias_col, x):
    """Row i's first `width` dims into x (float32) -> its bias (0 when bias_col < 0). Compiled per storage:
    int8 with one scale per SCALE_BLOCK dims, fp16 as its int16 bits, fp32."""


@overload(_decode, inline="always")
def _decode_for(vectors, scales, i, width, bias_col, x):
    if vectors.dtype == types.int8:
        def decode(vectors, scales, i, width, bias_col, x):
            for d in range(width):
                x[d] = vectors[i, d] * scales[i, d // SCALE_BLOCK]
            return vectors[i, bias_col] * scales[i, bias_col // SCALE_BLOCK] if bias_col >= 0 else np.float32(0.0)
    elif vectors.dtype == types.int16:
        def decode(vectors, scales, i, width, bias_col, x):
            for d in range(width):
                x[d] = HALF[vectors[i, d] & 0xFFFF]
            return HALF[vectors[i, bias_col] & 0xFFFF] if bias_col >= 0 else np.float32(0.0)
    else:
        def decode(vectors, scales, i, width, bias_col, x):
            for d in range(width):
                x[d] = vectors[i, d]
            return np.float32(vectors[i, bias_col]) if bias_col >= 0 else np.float32(0.0)
    return decode


@njit(inline="always")
def _score(x, bias, experts, keys, mask, b, top_n, logits, picked, picked_logit) -> np.float32:
    """The mixture-of-logits score of one decoded ad x (D + G,) for request b."""
    E, D, G = experts.shape[1], experts.shape[2], keys.shape[2]
    for e in range(E):
        logits[e] = -np.inf
        if mask[b, e]:
            acc = np.float32(0.0)
            for g in range(G):
                acc += keys[b, e, g] * x[D + g]
            logits[e] = acc
    n = 0
    for _ in range(min(top_n, E)):  # the top-n usable experts by logit, in descending order
        best = -1
        for e in range(E):
            if logits[e] > -np.inf and (best < 0 or logits[e] > logits[best]):
                best = e
        if best < 0:
            break
        picked[n], picked_logit[n] = best, logits[best]
        logits[best] = -np.inf
        n += 1
    if n == 0:
        return bias
    total, score = np.float32(0.0), np.float32(0.0)
    for j in range(n):
        weight = np.float32(math.exp(picked_logit[j] - picked_logit[0]))
        sim = np.float32(0.0)
        for d in range(D):
            sim += experts[b, picked[j], d] * x[d]
        total += weight
        score += weight * sim
    return score / total + bias


@njit(parallel=True, fastmath=FLAGS, cache=True)
def _fused(status, start, end, refs, vectors, scales, now, truth, experts, keys, mask, bias_col, top_n, m, tasks):
    """Per task and request its m best (scores (T, B, m), slots (T, B, m); -inf / -1 padded), and the
    eligible counts (T, B)."""
    n, B, E = status.shape[0], now.shape[0], experts.shape[1]
    width = experts.shape[2] + keys.shape[2]
    out_score = np.full((tasks, B, m), -np.inf, dtype=np.float32)
    out_slot = np.full((tasks, B, m), -1, dtype=np.int64)
    counts = np.zeros((tasks, B), dtype=np.int64)
    per = (n + tasks - 1) // tasks
    for t in prange(tasks):
        x = np.empty(width, dtype=np.float32)
        logits, picked_logit = np.empty(E, dtype=np.float32), np.empty(E, dtype=np.float32)
        picked = np.empty(E, dtype=np.int64)
        ok = np.empty(B, dtype=np.bool_)
        sizes = np.zeros(B, dtype=np.int64)
        for i in range(t * per, min(n, (t + 1) * per)):
            some = False
            for b in range(B):
                ok[b] = _matches(status, start, end, refs, truth, now, i, b)
                some |= ok[b]
            if not some:  # the vector's bytes are read only for an ad some request matches
                continue
            bias = _decode(vectors, scales, i, width, bias_col, x)
            for b in range(B):
                if ok[b]:
                    counts[t, b] += 1
                    score = _score(x, bias, experts, keys, mask, b, top_n, logits, picked, picked_logit)
                    if score != score:  # NaN ranks as -inf
                        score = -np.inf
                    sizes[b] = _push(out_score[t, b], out_slot[t, b], sizes[b], score, i)
    return out_score, out_slot, counts


@njit(parallel=True, cache=True)
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
