"""Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before they are defined."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
