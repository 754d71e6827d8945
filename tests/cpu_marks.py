"""Skip marks for tests of CPU kernels, each naming the instructions the CPU lacks."""

from __future__ import annotations

import pytest

from aserve.kernels import amx_linear, bf16_linear, f32_linear
from aserve.kernels.cbuild import cpu_flags

needs_amx = pytest.mark.skipif(not amx_linear.cpu_has_amx(),
                               reason="this CPU has no AMX (amx_tile, amx_bf16): the AMX kernels cannot run on it")
needs_avx512_bf16 = pytest.mark.skipif(not bf16_linear.cpu_supported(),
                                       reason="this CPU lacks AVX512-BF16 (avx512f, avx512_bf16)")
needs_bf16_kernel = pytest.mark.skipif(not (amx_linear.cpu_has_amx() or bf16_linear.cpu_supported()),
                                       reason="this CPU has neither AMX nor AVX512-BF16: no bf16 kernel runs on it")
needs_avx2_fma = pytest.mark.skipif(not f32_linear.cpu_supported(), reason="this CPU lacks AVX2 and FMA")
needs_avx512f = pytest.mark.skipif(not (cpu_flags() or frozenset()) >= {"avx512f", "avx2", "fma"},
                                   reason="this CPU lacks AVX-512F")
