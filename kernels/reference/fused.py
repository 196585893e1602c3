"""Reference of the fused retrieval pass over the compact ad table: it defines what every fused kernel
(Triton on CUDA, the compiled CPU path) must return. Raw tensors in, tensors out.

Table of n slots:
  status (n,) int8      LIVE | ACTIVE | SATISFIABLE bits (match.py); servable when all three are set
  start, end (n,) int64 the ad serves while start <= now < end
  refs (n, C) int32     clause references, ref = 2 * clause + negate: the ad matches a request when, for
                        every ref, (the request holds a value of `clause`) XOR negate. Clause 0 is never
                        held, so ref ALWAYS (= 1) pads a row.
  vectors (n, S)        stored ad vectors: float32, float16, or int8 with scales (n, ceil(S / 16)) float32,
                        one symmetric scale per block of SCALE_BLOCK dims (x = q * scale)
Request side, B requests:
  now (B,) int64; truth (B, W) int32 bit-packed: bit c % 32 of word c // 32 set when the request's user
  holds a value of clause c (W * 32 > every clause id in refs).
Head (a mixture of logits; the dot product is E = 1, G = 0): with a = vectors[:, :D], q = vectors[:, D:D + G]
and bias = vectors[:, bias_col] (0 when bias_col < 0), each candidate's gating logits keys[b, e] . q over
the experts with mask[b, e] pick its top_n experts (of equal logits, the lower expert; NaN above all); softmax over
those gives the gates (the others get gate 0; all gates are 0 when a usable logit is NaN or +inf, or none is
usable) and score = sum over the experts with gate_e > 0 of gate_e * <experts[b, e], a>, plus bias.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.reference.match import time_status_match
from kernels.reference.topk import ranked_scores

SCALE_BLOCK = 16  # int8 vectors: dims per scale
ALWAYS = 1  # the ref that pads a row of refs: "does not hold clause 0", true for every request


def in_parts(scan: Callable[..., tuple[torch.Tensor, ...]], requests: tuple[torch.Tensor, ...],
             part: int) -> tuple[torch.Tensor, ...]:
    """scan(*request side) over parts of at most `part` requests of the batch (requests: tensors of B rows; one part
    when B = 0), each output concatenated over the parts: what a pass too large for memory in one go runs."""
    outputs = [scan(*(t[i:i + part] for t in requests)) for i in range(0, max(requests[0].shape[0], 1), part)]
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def dequantize(vectors: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """(n, S) stored vectors (float32 / float16, or int8 with scales (n, ceil(S / 16))) -> (n, S) float32 (float64
    vectors stay float64)."""
    if vectors.dtype == torch.float64:
        return vectors
    if vectors.dtype != torch.int8:
        return vectors.float()
    return vectors.float() * scales.repeat_interleave(SCALE_BLOCK, dim=1)[:, : vectors.shape[1]]


def clause_match(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                 truth: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """Eligibility (B, n) bool of n slots for B requests (shapes in the module docstring)."""
    clause = (refs >> 1).long()
    negate = (refs & 1).bool()
    held = ((truth[:, clause >> 5] >> (clause & 31).int()) & 1).bool()  # (B, n, C)
    return time_status_match(status, start, end, now) & (held ^ negate).all(-1)


def top_n_gates(logits: torch.Tensor, top_n: int) -> torch.Tensor:
    """(B, E, n) gating logits (-inf: a masked expert) -> (B, E, n) gates: softmax over each candidate's top_n
    experts (of equal logits, the lower expert; NaN above all), 0 for the others; all 0 when a chosen logit is
    NaN or +inf, or none is usable. Expert e is chosen when fewer than top_n experts rank above it: a lower
    expert j < e with a logit >= e's, or a higher one with a logit > e's (comparisons with NaN are false, so a
    NaN, and the first +inf, always is; the softmax of a NaN or +inf is NaN throughout, which nan_to_num makes
    0). Counted pair by pair over the E experts (E is small): a sort along E costs several times more on CPU."""
    E = logits.shape[1]
    top_n = min(top_n, E)  # a larger one chooses every expert (and would wrap in the int16 comparison below)
    above = torch.zeros(logits.shape, dtype=torch.int16, device=logits.device)
    for j in range(E):
        other = logits[:, j: j + 1]
        above[:, :j] += other > logits[:, :j]
        above[:, j + 1:] += other >= logits[:, j + 1:]
    return torch.nan_to_num(torch.softmax(logits.masked_fill(above >= top_n, float("-inf")), dim=1))


def head_scores(vectors: torch.Tensor, scales: torch.Tensor | None, experts: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor, bias_col: int, top_n: int) -> torch.Tensor:
    """(B, n) float32 scores (float64 for float64 vectors: computed in that precision throughout): vectors (n, S),
    experts (B, E, D), keys (B, E, G), mask (B, E) bool."""
    D, G = experts.shape[2], keys.shape[2]
    x = dequantize(vectors, scales)
    logits = torch.einsum("beg,ng->ben", keys.to(x.dtype), x[:, D: D + G]).masked_fill(~mask[:, :, None], float("-inf"))
    gates = top_n_gates(logits, top_n)
    sims = torch.einsum("bed,nd->ben", experts.to(x.dtype), x[:, :D])
    terms = torch.where(gates > 0, gates * sims, 0.0)  # (B, E, n): a gate of 0 adds nothing, whatever its similarity
    score = terms.new_zeros((terms.shape[0], terms.shape[2]))
    for e in range(terms.shape[1]):  # expert by expert, elementwise: every slot's sum rounds alike (.sum(1) rounded
        score = score + terms[:, e]  # the table's last slots otherwise, so equal ads tied by their scores, not slots)
    return score + x[:, bias_col] if bias_col >= 0 else score


def order_slots(scores: torch.Tensor, ok: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, n), ok (B, n) bool -> the m best eligible (slots (B, m) int64, -1 padded; scores (B, m),
    -inf padded) by score descending, then slot ascending; NaN scores rank as -inf (before the ineligible)."""
    scores = ranked_scores(scores).masked_fill(~ok, float("-inf"))
    order = torch.argsort(scores, dim=1, descending=True, stable=True)  # stable: equal scores by slot
    order = order.gather(1, torch.argsort(ok.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True))[:, :m]
    slots = torch.where(ok.gather(1, order), order, -1)
    best = scores.gather(1, order).masked_fill(slots < 0, float("-inf"))
    pad = m - slots.shape[1]
    if pad > 0:
        slots = torch.cat([slots, slots.new_full((slots.shape[0], pad), -1)], 1)
        best = torch.cat([best, best.new_full((best.shape[0], pad), float("-inf"))], 1)
    return slots, best


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass: match, score, top-m -> (slots (B, m) int64, scores (B, m) float32, eligible (B,) int64)."""
    ok = clause_match(status, start, end, refs, truth, now)
    slots, best = order_slots(head_scores(vectors, scales, experts, keys, mask, bias_col, top_n), ok, m)
    return slots, best, ok.sum(1)
