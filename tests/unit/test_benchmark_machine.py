"""benchmarks.common.machine: the line every benchmark section starts with names the CPU's vector instructions,
which halve or double the CPU kernels' time."""
from __future__ import annotations

import pytest

from benchmarks.common import machine, vector_isa


@pytest.mark.parametrize("flags, isa", [({"sse2", "avx", "avx2", "fma", "avx512f"}, "AVX-512"),
                                        ({"sse2", "avx", "avx2", "fma"}, "AVX2 + FMA, no AVX-512"),
                                        ({"sse2", "avx", "avx2"}, "no AVX2: portable loops"),
                                        (set(), "no AVX2: portable loops")])
def test_the_widest_vector_instructions_the_kernels_use(flags, isa):
    assert vector_isa(flags) == isa


def test_the_machine_line_names_them_on_linux():
    line = machine()
    assert "cores available" in line and ("AVX" in line or "unknown CPU" in line)
