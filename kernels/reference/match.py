"""Reference targeting match over a slice of the ad table.

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


def bitset_match(pos: torch.Tensor, neg: torch.Tensor, user_bits: torch.Tensor) -> torch.Tensor:
    """pos (n, G, W) int32, neg (n, W) int32, user_bits (B, W) int32 -> (B, n) bool."""
    hit = ((pos[None] & user_bits[:, None, None, :]) != 0).any(-1)  # (B, n, G)
    unused = (pos == 0).all(-1)  # (n, G)
    positive_ok = (hit | unused[None]).all(-1)
    excluded = ((neg[None] & user_bits[:, None, :]) != 0).any(-1)
    return positive_ok & ~excluded


def list_match(pos: torch.Tensor, neg: torch.Tensor, user_table: torch.Tensor) -> torch.Tensor:
    """pos (n, G, L), neg (n, L) value indices (-1 pad), user_table (B, V + 1) bool -> (B, n) bool."""
    pad = user_table.shape[1] - 1
    pos_idx = torch.where(pos < 0, pad, pos.long())
    neg_idx = torch.where(neg < 0, pad, neg.long())
    hit = user_table[:, pos_idx].any(-1)  # (B, n, G)
    unused = (pos < 0).all(-1)
    positive_ok = (hit | unused[None]).all(-1)
    excluded = user_table[:, neg_idx].any(-1)
    return positive_ok & ~excluded


def targeting_match(
    status: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    now: torch.Tensor,
    bitset_columns: list[tuple[torch.Tensor, torch.Tensor]],
    user_bits: list[torch.Tensor],
    list_columns: list[tuple[torch.Tensor, torch.Tensor]],
    user_tables: list[torch.Tensor],
) -> torch.Tensor:
    """Eligibility (B, n) bool of n slots for B requests.

    bitset_columns[c] = (pos, neg) pairs aligned with user_bits[c]; likewise list_columns/user_tables.
    """
    ok = time_status_match(status, start, end, now)
    for (pos, neg), bits in zip(bitset_columns, user_bits, strict=True):
        ok &= bitset_match(pos, neg, bits)
    for (pos, neg), table in zip(list_columns, user_tables, strict=True):
        ok &= list_match(pos, neg, table)
    return ok
