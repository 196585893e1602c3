"""Reference status and time-window test of ad-table slots (the targeting part: fused.clause_match).

Status bits per slot: LIVE (slot holds an ad), ACTIVE (not paused), SATISFIABLE (targeting can match).
"""
from __future__ import annotations

import torch

LIVE, ACTIVE, SATISFIABLE = 1, 2, 4
SERVABLE = LIVE | ACTIVE | SATISFIABLE


def time_status_match(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """status (n,) int8, start/end (n,) int64, now (B,) int64 -> (B, n) bool: servable and start <= now < end."""
    servable = (status.to(torch.int32) & SERVABLE) == SERVABLE
    now = now[:, None]
    return servable[None, :] & (start[None, :] <= now) & (now < end[None, :])
