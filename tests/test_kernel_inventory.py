"""The one line `.ci/run` prints about what this CPU lets the suite test."""

from __future__ import annotations

from aserve.kernels.inventory import describe


def test_the_line_names_the_flags_and_the_forms_each_cpu_kind_runs():
    avx2 = describe(frozenset({"avx2", "fma", "sse2"}), model="AMD EPYC")
    assert "flags: avx2 fma;" in avx2 and "(AVX2 form)" in avx2 and "no AMX kernels" in avx2
    assert "no AVX512-BF16 kernels" in avx2
    avx512 = describe(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}), model="AMD EPYC")
    assert "AVX-512 and AVX2 forms" in avx512 and "avx512_bf16" in avx512
    assert "AVX512-BF16 bf16 linear, prefill attention + its one-call decode, decode shared prefix" in avx512
    assert "no AMX kernels" in avx512
    amx = describe(frozenset({"avx2", "fma", "avx512f", "amx_tile", "amx_bf16"}), model="Xeon")
    assert "AMX bf16 linear" in amx and "gated MLP fused" in amx and "decode shared prefix" in amx
    old = describe(frozenset({"sse2"}), model="old")
    assert "no float32 linear or prefill attention kernel (needs AVX2 and FMA)" in old
