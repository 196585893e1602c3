"""tests/triton_interpreter.py's speed-ups of Triton's interpreter (applied by tests/conftest.py on CPU) keep its
results: tl.xor_sum against Python's XOR, and a kernel whose jit helpers run after the launch patched the language."""
from __future__ import annotations

import functools
import operator
import os

import numpy as np
import pytest
import torch

import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@triton.jit
def _xor_rows(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr):
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    x = tl.load(x_ptr + rows[:, None] * COLS + cols[None, :])
    if AXIS == 0:
        tl.store(out_ptr + cols, tl.xor_sum(x, 0))
    else:
        tl.store(out_ptr + rows, tl.xor_sum(x, 1))


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _top_of_doubled(x_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr):
    x = _twice(tl.load(x_ptr + tl.arange(0, N)))
    tl.store(out_ptr + tl.arange(0, K), tl.topk(_twice(x), K))


def test_both_speed_ups_apply_to_this_triton():
    """Triton is pinned (constraints-cpu.txt); a version whose internals differ fails here, not by slower tests alone."""
    from triton.runtime import interpreter

    assert interpreter._patch_lang.__name__ == "patch_once"
    assert interpreter.ReduceOps.apply_impl.__name__ == "apply_xor_in_numpy"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("axis", [0, 1])
def test_xor_sum_is_the_xor_of_the_values(dtype, axis):
    gen = torch.Generator().manual_seed(axis)
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (4, 8), generator=gen, dtype=dtype)
    out = torch.empty(x.shape[1 - axis], dtype=dtype)
    _xor_rows[(1,)](x, out, 4, 8, axis)
    lines = x.T.tolist() if axis == 0 else x.tolist()
    assert out.tolist() == [functools.reduce(operator.xor, line) for line in lines]


@pytest.mark.parametrize("dtype", ["int1", "uint8", "int16", "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("axis, keep_dims", [(0, False), (1, False), (0, True), (1, True), (None, False), (-1, True)])
def test_xor_sum_gives_what_the_interpreters_own_reduction_gives(dtype, axis, keep_dims):
    """Values, shape and type of the numpy reduction against the interpreter's element-by-element one."""
    from triton.runtime import interpreter

    triton_type = getattr(tl, dtype)
    data = np.random.default_rng(len(dtype)).integers(0, 2**8, (4, 8)).astype(interpreter._get_np_dtype(triton_type))
    x = tl.core.tensor(interpreter.TensorHandle(data, triton_type), tl.block_type(triton_type, [4, 8]))
    reduce = interpreter.ReduceOps(axis, tl.standard._xor_combine, keep_dims)
    scope = interpreter._patch_lang.__wrapped__(_xor_rows.fn)  # the language as in a launch, for the combine
    try:
        got, want = reduce.apply(x), reduce.generic_reduce((x,))[0]
    finally:
        scope.restore()
    assert got.type == want.type and got.handle.data.dtype == want.handle.data.dtype
    assert np.array_equal(got.handle.data, want.handle.data)


def test_jit_helpers_called_again_in_later_launches_give_the_same_answers():
    x = torch.tensor([3.0, -1.0, 7.5, 0.25, 2.0, -8.0, 5.0, 1.0])
    for _ in range(2):  # the second launch patches the language afresh
        out = torch.empty(4)
        _top_of_doubled[(1,)](x, out, 8, 4)
        assert out.tolist() == sorted((4 * x).tolist(), reverse=True)[:4]
