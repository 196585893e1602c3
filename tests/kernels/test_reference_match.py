"""The reference match against an element-by-element loop over random compact tables at odd sizes."""
from __future__ import annotations

import pytest
import torch

from kernels.reference.fused import ALWAYS, clause_match
from kernels.reference.match import ACTIVE, LIVE, SATISFIABLE


def loop_match(status, start, end, refs, truth, now):
    B, n = now.shape[0], status.shape[0]
    out = torch.zeros((B, n), dtype=torch.bool)
    for b in range(B):
        words = [w & 0xFFFFFFFF for w in truth[b].tolist()]
        for i in range(n):
            ok = int(status[i]) & 7 == 7 and int(start[i]) <= int(now[b]) < int(end[i])
            for ref in refs[i].tolist():
                clause, negate = ref >> 1, ref & 1
                held = (words[clause // 32] >> (clause % 32)) & 1
                ok &= held != negate
            out[b, i] = ok
    return out


@pytest.mark.parametrize("n, B, C, W", [(7, 1, 1, 1), (83, 3, 3, 2), (211, 2, 6, 3)])
def test_matches_loop(n, B, C, W):
    gen = torch.Generator().manual_seed(n)
    status = torch.tensor([LIVE | ACTIVE | SATISFIABLE, LIVE | ACTIVE, LIVE | SATISFIABLE, 0, 7])[
        torch.randint(0, 5, (n,), generator=gen)].to(torch.int8)
    start = torch.randint(0, 10, (n,), generator=gen)
    end = start + torch.randint(1, 10, (n,), generator=gen)
    now = torch.randint(0, 15, (B,), generator=gen)
    refs = torch.randint(2, 64 * W, (n, C), generator=gen).to(torch.int32)  # clause ids 1 .. 32 W - 1, either sign
    refs = torch.where(torch.rand((n, C), generator=gen) < 0.3, ALWAYS, refs)
    truth = torch.randint(-2**31, 2**31 - 1, (B, W), generator=gen, dtype=torch.int64).to(torch.int32)
    truth[:, 0] &= ~1  # clause 0 is never held
    got = clause_match(status, start, end, refs, truth, now)
    assert torch.equal(got, loop_match(status, start, end, refs, truth, now))
    assert 0 < int(got.sum()) or n < 100  # the random draw exercises both outcomes at the larger sizes
