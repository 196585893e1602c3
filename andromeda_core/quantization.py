"""Ad-vector storage formats: fp32, fp16, or int8 with one symmetric scale per ad."""
from __future__ import annotations

import torch

STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, D) float -> (q (n, D) int8, scale (n,) float32) with x ~= q * scale[:, None]."""
    scale = x.float().abs().amax(1).clamp(min=1e-12) / 127
    return (x.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Stored (n, D) vectors in any storage format -> float32."""
    return stored.float() * scale[:, None] if stored.dtype == torch.int8 else stored.float()


def round_trip(x: torch.Tensor, storage: str) -> torch.Tensor:
    """x as it reads back after being stored in `storage`."""
    if storage == "int8":
        return dequantize(*quantize_int8(x))
    return x.to(STORAGE[storage]).float()
