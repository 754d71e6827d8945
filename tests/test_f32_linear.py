"""The float32 linear kernel (aserve/kernels/f32_linear.py), in the form this CPU's build
runs (AVX-512 or AVX2): against a float64 reference at every row-block remainder, with
and without a bias, on strided inputs; independent of the thread count and of the other
rows; the AVX-512 form giving the AVX2 form's bits; and which layers get it."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM
from aserve.kernels import f32_linear
from tests.cpu_marks import needs_avx2_fma as needs_kernel
from tests.cpu_marks import needs_avx512f as needs_avx512


def test_which_cpus_it_is_for():
    assert f32_linear.cpu_supported(frozenset({"avx2", "fma", "sse2"}))
    assert f32_linear.cpu_supported(frozenset({"avx2", "fma", "avx512f"}))
    assert not f32_linear.cpu_supported(frozenset({"avx", "sse2"}))


@needs_avx512
def test_the_avx512_form_gives_the_avx2_forms_bits(kernel):
    narrow = f32_linear.load(extra_flags=("-mno-avx512f",))
    assert (kernel.form, narrow.form) == (512, 256)
    g = torch.Generator().manual_seed(7)
    for n, k, rows in ((16, 1, 1), (40, 17, 9), (427, 256, 33), (700, 300, 17), (48, 64, 8)):
        w, bias, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
        for b in (None, bias):
            assert torch.equal(kernel.linear(x, kernel.pack(w), n, b), narrow.linear(x, narrow.pack(w), n, b))


@pytest.fixture(scope="module")
def kernel() -> f32_linear.F32Linear:
    k = f32_linear.load()
    assert k is not None
    return k


@needs_kernel
@pytest.mark.parametrize("n, k", [(16, 1), (40, 17), (427, 256), (256, 1408)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 33, 300])
def test_matches_a_float64_reference(kernel, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    wide = torch.randn(rows, k + 5, generator=g)
    x = wide[:, 2 : 2 + k]  # rows k + 5 apart
    packed = kernel.pack(w)
    for b in (None, bias):
        got = kernel.linear(x, packed, n, b)
        want = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert got.shape == (rows, n)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * k**0.5), (got.double() - want).abs().max()


@needs_kernel
def test_results_do_not_depend_on_threads_or_on_other_rows(kernel, set_threads):
    g = torch.Generator().manual_seed(3)
    w, x, bias = torch.randn(100, 64, generator=g), torch.randn(31, 64, generator=g), torch.randn(100, generator=g)
    packed = kernel.pack(w)
    set_threads(1)
    one = kernel.linear(x, packed, 100, bias)
    set_threads(2)
    two = kernel.linear(x, packed, 100, bias)
    assert torch.equal(one, two)
    # A row computed alone, or in another position of its block, gives the same bits.
    for r in (0, 5, 6, 30):
        assert torch.equal(kernel.linear(x[r : r + 1], packed, 100, bias)[0], one[r])
        assert torch.equal(kernel.linear(x[max(0, r - 3) : r + 1], packed, 100, bias)[-1], one[r])


@needs_kernel
def test_small_float32_layers_get_it_and_the_switch_turns_it_off(llama_dir, monkeypatch):
    from aserve.model.layers.linear import PackedMatmul

    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 22)
    layers = [m for m in llm.engine.executor.worker.runner.model.modules() if isinstance(m, PackedMatmul)]
    assert layers and all(m.f32 is not None and m.transposed_weight is None for m in layers)
    assert all(m.weight.numel() == 0 for m in layers)  # only the packed copy is kept (no tied head here)
    monkeypatch.setenv("ASERVE_CPU_F32_LINEAR", "0")
    assert f32_linear.load() is None
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 22)
    layers = [m for m in llm.engine.executor.worker.runner.model.modules() if isinstance(m, PackedMatmul)]
    assert all(m.f32 is None and m.transposed_weight is not None for m in layers)
