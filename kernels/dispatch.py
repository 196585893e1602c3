"""One entry point per fused op: Triton on CUDA tensors, the compiled C++ CPU kernel otherwise. Both
reproduce kernels.reference.fused; the reference itself is what tests compare them with.

A head the GPU cannot build the scan for (its operands past the shared memory a block may have, or its registers:
compiled for sm_90 by Triton 3.9, int8 tables with D = 128 and more than 8 experts, any int8 table with D = 256,
float32 ones with D = 256) is scored by the reference on the GPU instead: the same results, slower, its (B, E, n)
intermediates taken a few requests at a time. A warning names the head once per process; the default heads
(D = 64, G = 16) fit in every dtype."""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)
UNBUILDABLE: set = set()  # heads (table dtype, E, D, G) the GPU could not build the Triton scan for
REFERENCE_BYTES = 1 << 30  # the reference's intermediates for such a head, at most (reference_in_parts)


def implementation(device: torch.device | str) -> str:
    """The kernel family the ops below run on `device`."""
    return "triton" if torch.device(device).type == "cuda" else "cpp-cpu"


def require_top(m: int, top_n: int) -> None:
    """The fused ops keep the m best of the top_n experts' mixture: both must be at least 1."""
    if m < 1 or top_n < 1:
        raise ValueError(f"m and top_n must be at least 1, got m={m}, top_n={top_n}")


COMPILED_STORAGE = (torch.float32, torch.float16, torch.int8)  # table dtypes the compiled kernels read; others: reference


def require_match_inputs(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                         truth: torch.Tensor, now: torch.Tensor) -> None:
    """The match's operands as the compiled kernels read them (raw pointers): status int8 (n,), start and end int64
    and refs int32 (n, C) of at least n rows, truth int32 (B, W) with W >= 1, now int64 (B,). Raises ValueError
    naming the first that is not (another dtype or fewer rows would be read wrongly or past its end). The refs'
    values are the caller's to keep below 32 W clauses (AdIndex does): they are not read here."""
    n, B = status.shape[0], now.shape[0]
    for name, t, dtype, dims, rows in (("status", status, torch.int8, 1, n), ("start", start, torch.int64, 1, n),
                                       ("end", end, torch.int64, 1, n), ("refs", refs, torch.int32, 2, n),
                                       ("truth", truth, torch.int32, 2, B), ("now", now, torch.int64, 1, B)):
        if t.dtype != dtype or t.dim() != dims or t.shape[0] < rows:
            raise ValueError(f"{name}: {t.dtype} of shape {tuple(t.shape)}, where the kernels read {dtype} of {dims} "
                             f"dims and at least {rows} rows")
    if truth.shape[0] != B or truth.shape[1] < 1:
        raise ValueError(f"truth: shape {tuple(truth.shape)}, where the kernels read {B} rows of at least one column")


def require_head(B: int, experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> None:
    """experts (B, E, D), keys (B, E, G) and mask (B, E), one row per request: ValueError otherwise (the compiled
    kernels would read past a shorter one)."""
    E = experts.shape[1] if experts.dim() == 3 else -1
    if experts.dim() != 3 or experts.shape[0] != B or keys.dim() != 3 or tuple(keys.shape[:2]) != (B, E) \
            or tuple(mask.shape) != (B, E):
        raise ValueError(f"a head of experts {tuple(experts.shape)}, keys {tuple(keys.shape)}, mask {tuple(mask.shape)} "
                         f"for {B} requests: want (B, E, D), (B, E, G), (B, E)")


def require_rows(n: int, vectors: torch.Tensor, scales: torch.Tensor | None, D: int, G: int, bias_col: int) -> None:
    """The kernels read, for each of the n slots, D + G dims and the bias column of its row of vectors, and for an
    int8 table the scale of each block of SCALE_BLOCK of those: raises ValueError where the tensors hold less (the
    compiled kernels would read past them)."""
    from kernels.reference.fused import SCALE_BLOCK

    width = max(D + G, bias_col + 1)
    if vectors.dim() != 2 or vectors.shape[0] < n or vectors.shape[1] < width:
        raise ValueError(f"vectors of shape {tuple(vectors.shape)}: the scan reads {n} rows of {width} columns")
    blocks = -(-width // SCALE_BLOCK)
    if vectors.dtype == torch.int8 and (scales is None or scales.dim() != 2 or scales.shape[0] < n
                                        or scales.shape[1] < blocks):
        raise ValueError(f"int8 vectors need scales of {n} rows of {blocks} blocks of {SCALE_BLOCK} columns, got "
                         f"{None if scales is None else tuple(scales.shape)}")


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Match, score and top-m in one pass (kernels.reference.fused.fused_scan) on the table's device; a table of
    another dtype than COMPILED_STORAGE (float64, bfloat16), or on the CPU a head of more experts than its kernel
    holds (kernels.cpu.LANES), by the reference."""
    require_top(m, top_n)
    require_match_inputs(status, start, end, refs, truth, now)
    require_head(now.shape[0], experts, keys, mask)
    require_rows(status.shape[0], vectors, scales, experts.shape[2], keys.shape[2], bias_col)
    args = (status, start, end, refs, vectors, scales, now, truth, experts, keys, mask, bias_col, top_n)
    if vectors.dtype not in COMPILED_STORAGE:
        return reference_in_parts(*args, m)
    if not vectors.is_cuda:
        from kernels.cpu import LANES, fused_scan as run
        return run(*args, m) if experts.shape[1] <= LANES else reference_in_parts(*args, m)
    from kernels.triton.fused import fused_scan as run
    with on_its_gpu(vectors):
        return built_or_reference(lambda: run(*args, m), lambda: reference_in_parts(*args, m),
                                  head_of(vectors, experts, keys))


def reference_in_parts(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                       vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
                       experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
                       m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.reference.fused.fused_scan over parts of the batch, so that its (B, E, n) intermediates (gating
    logits, gates and similarities in float32, an int16 rank: 14 bytes per request, expert and slot) stay within
    REFERENCE_BYTES (a part is one request at the least)."""
    from kernels.reference import fused as reference

    part = max(1, REFERENCE_BYTES // (14 * experts.shape[1] * max(status.shape[0], 1)))
    table = (status, start, end, refs, vectors, scales)
    return reference.in_parts(lambda *side: reference.fused_scan(*table, *side, bias_col, top_n, m),
                              (now, truth, experts, keys, mask), part)


def head_of(vectors: torch.Tensor, experts: torch.Tensor, keys: torch.Tensor) -> tuple:
    """What the Triton scan is compiled for, as far as its size goes: (table dtype, E, D, G)."""
    return vectors.dtype, experts.shape[1], experts.shape[2], keys.shape[2]


def built_or_reference(triton_run: Callable, reference_run: Callable, head: tuple):
    """triton_run(), or reference_run() where the GPU cannot build the Triton kernels for `head` (Triton's
    OutOfResources or PTXASError, met at the first launch): the head is remembered, so it is tried once."""
    from triton.runtime.errors import OutOfResources, PTXASError

    if head not in UNBUILDABLE:
        try:
            return triton_run()
        except (OutOfResources, PTXASError) as error:
            UNBUILDABLE.add(head)
            log.warning("the GPU cannot build the fused scan for a %s table with %d experts, D = %d, G = %d (%s): "
                        "scoring with the PyTorch reference instead (exact, slower, its (B, E, n) intermediates a "
                        "few requests at a time); float16 tables or fewer experts or dims fit", *head, type(error).__name__)
    return reference_run()


def on_its_gpu(t: torch.Tensor):
    """A context making t's GPU the current device: Triton launches on the current device and its stream, whichever
    GPU the tensors are on (a table on cuda:1 would be read from cuda:0). Nothing for a CPU tensor."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def warm_up(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor, vectors: torch.Tensor,
            scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor, experts: torch.Tensor,
            keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int) -> None:
    """Compile what fused_scan may launch over this table with this head, before requests wait for it: on CUDA
    every Triton kernel variant (kernels.triton.fused.warm_up); on the CPU the C++ kernel, built once for all."""
    if vectors.is_cuda:
        from kernels.triton.fused import warm_up as run
        with on_its_gpu(vectors):
            built_or_reference(lambda: run(status, start, end, refs, vectors, scales, now, truth, experts, keys, mask,
                                           bias_col, top_n), lambda: None, head_of(vectors, experts, keys))
    else:
        from kernels.cpu import library
        library()


def clause_match(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                 truth: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """Eligibility (B, n) bool (kernels.reference.fused.clause_match) on the table's device."""
    require_match_inputs(status, start, end, refs, truth, now)
    if status.is_cuda:
        from kernels.triton.match import clause_match_count
        with on_its_gpu(status):
            return clause_match_count(status, start, end, refs, truth, now)[0]
    from kernels.cpu import clause_match as run
    return run(status, start, end, refs, truth, now)
