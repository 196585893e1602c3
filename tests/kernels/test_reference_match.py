"""The reference match against an element-by-element loop over random columns at odd sizes."""
from __future__ import annotations

import pytest
import torch

from kernels.reference.match import ACTIVE, LIVE, SATISFIABLE, targeting_match


def loop_match(status, start, end, now, bitsets, user_bits, lists, tables):
    B, n = now.shape[0], status.shape[0]
    out = torch.zeros((B, n), dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            ok = int(status[i]) & 7 == 7 and int(start[i]) <= int(now[b]) < int(end[i])
            for (pos, neg), bits in zip(bitsets, user_bits):
                for g in range(pos.shape[1]):
                    words = pos[i, g].tolist()
                    if any(words) and not any(w & u for w, u in zip(words, bits[b].tolist())):
                        ok = False
                ok &= not any(w & u for w, u in zip(neg[i].tolist(), bits[b].tolist()))
            for (pos, neg), table in zip(lists, tables):
                held = {v for v in range(table.shape[1] - 1) if table[b, v]}
                for g in range(pos.shape[1]):
                    group = {v for v in pos[i, g].tolist() if v >= 0}
                    if group and not group & held:
                        ok = False
                ok &= not ({v for v in neg[i].tolist() if v >= 0} & held)
            out[b, i] = ok
    return out


@pytest.mark.parametrize("n, B, W, G, L, V", [(7, 1, 1, 1, 2, 5), (83, 3, 3, 2, 4, 11), (211, 2, 2, 3, 3, 7)])
def test_matches_loop(n, B, W, G, L, V):
    gen = torch.Generator().manual_seed(n)

    def sparse_words(*shape):
        words = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        return words * (torch.rand(shape, generator=gen) < 0.3)

    status = torch.tensor([LIVE | ACTIVE | SATISFIABLE, LIVE | ACTIVE, LIVE | SATISFIABLE, 0, 7])[
        torch.randint(0, 5, (n,), generator=gen)].to(torch.int8)
    start = torch.randint(0, 10, (n,), generator=gen)
    end = start + torch.randint(1, 10, (n,), generator=gen)
    now = torch.randint(0, 15, (B,), generator=gen)
    bitsets = [(sparse_words(n, G, W), sparse_words(n, W)) for _ in range(2)]
    user_bits = [torch.randint(-2**31, 2**31 - 1, (B, W), generator=gen, dtype=torch.int64).to(torch.int32) for _ in range(2)]
    lists = [(torch.randint(-1, V, (n, G, L), generator=gen).to(torch.int16), torch.randint(-3, V, (n, L), generator=gen).clamp(min=-1).to(torch.int16))]
    tables = [torch.cat([torch.rand((B, V), generator=gen) < 0.4, torch.zeros((B, 1), dtype=torch.bool)], 1)]
    got = targeting_match(status, start, end, now, bitsets, user_bits, lists, tables)
    assert torch.equal(got, loop_match(status, start, end, now, bitsets, user_bits, lists, tables))
    assert 0 < int(got.sum()) or n < 100  # the random draw exercises both outcomes at the larger sizes
