"""benchmarks.kernels: the vector bytes it counts are those of the rows the pass reads, once per batch."""
from __future__ import annotations

import torch

from benchmarks.kernels import Requests, Table, rows_read
from kernels.reference.fused import ALWAYS


def test_rows_read_is_the_share_of_ads_some_request_of_the_batch_may_be_served():
    """Ads 0-1 run in [0, 10), ad 2 in [10, 20), ad 3 is paused: a request at 5 is eligible for two ads, one at 15
    for one; both together read three rows of four (the mean eligible share would say 3 of 8)."""
    status = torch.tensor([7, 7, 7, 0], dtype=torch.int8)
    start, end = torch.tensor([0, 0, 10, 0]), torch.tensor([10, 10, 20, 20])
    table = Table(status, start, end, torch.full((4, 1), ALWAYS, dtype=torch.int32), torch.zeros((4, 3)))
    requests = Requests(torch.tensor([5, 15]), torch.zeros((2, 1), dtype=torch.int32))
    assert rows_read(table, requests, 1) == 0.5
    assert rows_read(table, requests, 2) == 0.75
