"""Triton clause match over the compact ad table: kernels.reference.fused.clause_match, and its count per request.

Each program loads one block of BLOCK slots once and matches it against every request of the batch.
The block helpers here are shared with the fused scan (fused.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.fused import ALWAYS
from kernels.reference.match import SERVABLE

BLOCK = 128  # slots per program

_ALWAYS = tl.constexpr(ALWAYS)
_SERVABLE = tl.constexpr(SERVABLE)


@triton.jit
def load_slots(status_ptr, start_ptr, end_ptr, refs_ptr, offs, n, C: tl.constexpr, STRIDE_R: tl.constexpr,
               CP: tl.constexpr):
    """Slots offs (BLOCK,) int64 -> servable (BLOCK,) bool, start, end (BLOCK,) int64, clause, negate (BLOCK, CP)
    int32 (refs rows STRIDE_R apart, unit column stride). Slots at or past n are not servable; refs past C read as
    ALWAYS. A constant STRIDE_R lets a thread load a whole row of refs at once (and match it without shuffles)."""
    valid = offs < n
    status = tl.load(status_ptr + offs, mask=valid, other=0).to(tl.int32)
    start = tl.load(start_ptr + offs, mask=valid, other=0)
    end = tl.load(end_ptr + offs, mask=valid, other=0)
    cols = tl.arange(0, CP)[None, :]
    inside = valid[:, None]
    if C < CP:
        inside = inside & (cols < C)
    refs = tl.load(refs_ptr + offs[:, None] * STRIDE_R + cols, mask=inside, other=_ALWAYS)
    return valid & ((status & _SERVABLE) == _SERVABLE), start, end, refs >> 1, refs & 1


@triton.jit
def match_request(servable, start, end, clause, negate, truth_row_ptr, now):
    """One request (truth row (W,) int32, now int64) against a block -> (BLOCK,) bool eligibility."""
    words = tl.load(truth_row_ptr + (clause >> 5))  # clause ids < W * 32; padding reads clause 0 (word 0)
    held = (words >> (clause & 31)) & 1
    refs_ok = tl.min(held ^ negate, axis=1) == 1
    return servable & (start <= now) & (now < end) & refs_ok


@triton.jit
def _match_kernel(status_ptr, start_ptr, end_ptr, refs_ptr, truth_ptr, now_ptr, mask_ptr, counts_ptr,
                  n, B, W, C: tl.constexpr, STRIDE_R: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """Writes mask (B, n) int8 and adds each request's count of eligible slots of this block to counts (B,)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    servable, start, end, clause, negate = load_slots(status_ptr, start_ptr, end_ptr, refs_ptr, offs, n, C,
                                                      STRIDE_R, CP)
    mask_row = mask_ptr
    for b in range(B):
        ok = match_request(servable, start, end, clause, negate, truth_ptr + b * W, tl.load(now_ptr + b))
        tl.store(mask_row + offs, ok.to(tl.int8), mask=offs < n)
        tl.atomic_add(counts_ptr + b, tl.sum(ok.to(tl.int64)))
        mask_row += n  # pointer arithmetic is 64-bit: b * n could overflow int32


def refs_with_a_column(refs: torch.Tensor) -> torch.Tensor:
    """(n, C) int32 refs -> the same with unit column stride, or (n, 1) of ALWAYS when C == 0 (an empty tensor is no
    valid pointer)."""
    if not refs.shape[1]:
        return refs.new_full((refs.shape[0], 1), ALWAYS)
    return refs if refs.stride(1) == 1 else refs.contiguous()


def clause_match_count(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                       truth: torch.Tensor, now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """status (n,) int8, start/end (n,) int64, refs (n, C) int32, truth (B, W) int32, now (B,) int64
    -> (mask (B, n) bool, counts (B,) int64), as kernels.reference.fused.clause_match and its sum."""
    B, n = now.shape[0], status.shape[0]
    refs = refs_with_a_column(refs)
    mask = torch.empty((B, n), dtype=torch.int8, device=status.device)
    counts = torch.zeros(B, dtype=torch.int64, device=status.device)
    _match_kernel[(max(triton.cdiv(n, BLOCK), 1),)](
        status.contiguous(), start.contiguous(), end.contiguous(), refs, truth.to(torch.int32).contiguous(),
        now.to(torch.int64).contiguous(), mask, counts, n, B, truth.shape[1], C=refs.shape[1], STRIDE_R=refs.stride(0),
        CP=triton.next_power_of_2(refs.shape[1]), BLOCK=BLOCK)
    return mask.view(torch.bool), counts
