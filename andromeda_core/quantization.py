"""Ad-vector storage formats: fp32, fp16, or int8 with one symmetric scale per block of 16 dims.

Per-block scales keep a large block (e.g. the gating query) from coarsening the others (the unit ad
embedding): int8 costs D bytes plus 4 bytes per block.
"""
from __future__ import annotations

import torch

STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 16
ROW_ALIGN = 64  # bytes: a cache line


def aligned_rows(n: int, dim: int, dtype: torch.dtype, fill: float = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """An (n, dim) tensor filled with `fill` whose rows start ROW_ALIGN bytes apart or a multiple of that (a view of a
    buffer padded per row): a scan that reads part of each of a few scattered rows touches fewer cache lines.
    Measured: fp16 rows of 113 dims, padded to 128, made the CPU pass 5% faster at one request."""
    per_line = ROW_ALIGN // torch.empty((), dtype=dtype).element_size()
    width = -(-dim // per_line) * per_line
    return torch.full((n, width), fill, dtype=dtype, device=device)[:, :dim]


def int8_blocks(dim: int) -> int:
    return (dim + INT8_BLOCK - 1) // INT8_BLOCK


def _per_dim(scale: torch.Tensor, dim: int) -> torch.Tensor:
    return scale.repeat_interleave(INT8_BLOCK, dim=1)[:, :dim]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, D) float -> (q (n, D) int8, scale (n, ceil(D / 16)) float32) with x ~= q * scale per block."""
    x = x.float()
    n, dim = x.shape
    padded = torch.nn.functional.pad(x.abs(), (0, int8_blocks(dim) * INT8_BLOCK - dim))
    scale = padded.view(n, -1, INT8_BLOCK).amax(2).clamp(min=1e-12) / 127
    return (x / _per_dim(scale, dim)).round().clamp(-127, 127).to(torch.int8), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Stored (n, D) vectors in any storage format -> float32."""
    return stored.float() * _per_dim(scale, stored.shape[1]) if stored.dtype == torch.int8 else stored.float()


def round_trip(x: torch.Tensor, storage: str) -> torch.Tensor:
    """x as it reads back after being stored in `storage`."""
    if storage == "int8":
        return dequantize(*quantize_int8(x))
    return x.to(STORAGE[storage]).float()
