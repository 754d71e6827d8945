"""The fused RMSNorm, SiLU * up and rotary C kernels against Hugging Face's torch
formulas, and the KV pool's C write against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu_fused_ops
from aserve.kernels.attention import write_kv
from tests.kv_layout import LAYOUTS, in_layout


@pytest.fixture(scope="module")
def ops():
    loaded = cpu_fused_ops.load()
    assert loaded is not None, "the kernels must build on these machines (gcc is part of the setup)"
    return loaded



def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm.forward, as transformers writes it.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def ulp_tolerance(dtype: torch.dtype) -> dict:
    # float32: the sum of squares is added in another order (last-bit differences);
    # bfloat16: that can move a result across one rounding boundary (one bf16 ulp).
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,threads", [(1, 64, 1), (32, 256, 1), (300, 1024, 2), (5, 100, 2)])
def test_rms_norm_matches_hugging_face(ops, set_threads, dtype, rows, hidden, threads):
    set_threads(threads)
    gen = torch.Generator().manual_seed(rows + hidden)
    # x as the layers pass it: rows of a wider tensor (strided), last dim contiguous.
    x = (torch.randn(rows, hidden + 8, generator=gen) * 3).to(dtype)[:, 4 : 4 + hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out, none = ops.rms_norm(x, weight, 1e-5)
    assert none is None and out.dtype == dtype and out.shape == (rows, hidden)
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-5), **ulp_tolerance(dtype))
    out, new_residual = ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, x + residual)  # the add, rounded in the dtype
    torch.testing.assert_close(out, hf_rms_norm(x + residual, weight, 1e-5), **ulp_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter,threads", [(1, 40, 1), (32, 704, 1), (200, 2816, 2), (3, 17, 2)])
def test_silu_mul_matches_torch(ops, set_threads, dtype, rows, inter, threads):
    set_threads(threads)
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # the clamped ends and zero
    out = ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, **ulp_tolerance(dtype))


def test_silu_mul_vector_lanes_give_the_scalar_loops_results(ops):
    """Element 16 of a 17-wide row is the scalar tail under AVX-512 and AVX2 alike; row r
    repeats element r there, so each vector lane is checked against the loop: within
    two float32 ulps (the loop's exp may round its steps differently, and AVX-512
    approximates 1 / x)."""
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(16, 17, generator=gen) * 4, torch.randn(16, 17, generator=gen)
    rows = torch.arange(16)
    gate[:, 16], up[:, 16] = gate[rows, rows], up[rows, rows]
    out = ops.silu_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out[:, 16], out[rows, rows], rtol=2.5e-7, atol=1e-9)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_FUSED_OPS", "0")
    assert cpu_fused_ops.load() is None


def test_attached_to_every_norm_and_mlp(ops):
    from aserve.model.layers.norm import RMSNorm
    from aserve.model.models.llama import LlamaMLP

    model = torch.nn.ModuleList([RMSNorm(8, 1e-6, dtype=torch.float32), torch.nn.Linear(2, 2)])
    assert cpu_fused_ops.attach(model, ops) == 1
    assert model[0].fused_ops is ops and not hasattr(model[1], "fused_ops")
    assert LlamaMLP.fused_ops is None  # the class default: torch ops until attached


def test_torch_path_gives_the_kernels_tokens(monkeypatch, llama_dir):
    """With the kernels switched off the layers' torch forms decode the same greedy
    tokens (both are checked against transformers in test_hf_parity with the kernels)."""
    from aserve import LLM, SamplingParams

    prompts = [[5, 9, 14, 3], list(range(10, 50)), [7] * 19]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21)]
    fused_llm = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    norm = fused_llm.engine.executor.worker.runner.model.model.norm
    assert norm.fused_ops is not None
    with_kernels = [o.outputs[0].token_ids for o in fused_llm.generate(prompts, params)]
    monkeypatch.setenv("ASERVE_CPU_FUSED_OPS", "0")
    llm = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    assert llm.engine.executor.worker.runner.model.model.norm.fused_ops is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_kernels


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # apply_rotary_pos_emb, as transformers writes it (cos/sin over the whole head).
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,threads", [(1, 1), (32, 1), (600, 2)])
def test_rotary_matches_hugging_face_in_place(ops, set_threads, dtype, tokens, threads):
    set_threads(threads)
    gen = torch.Generator().manual_seed(tokens)
    hq, hk, dim = 4, 2, 64
    qkv = torch.randn(tokens, hq + 2 * hk, dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    before = qkv.clone()
    qk = qkv[:, : hq + hk]  # the strided view the attention layer rotates
    out = ops.rotary_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, hq + hk :], before[:, hq + hk :])  # v untouched
    expected = hf_rotary(before[:, : hq + hk], cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(qk, expected)  # the same roundings, so the same bits
    else:
        torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("tokens,threads", [(1, 1), (37, 2), (700, 2)])
def test_write_kv_fills_the_slots_torch_would(ops, set_threads, layout, model_dtype, cache_dtype, tokens, threads):
    """Keys and values as the model passes them (strided slices of the projected rows)
    into scattered slots of either layout: the same cache, bit for bit, as torch's
    index_copy_ into a token-major one, and nothing else changed."""
    set_threads(threads)
    g = torch.Generator().manual_seed(tokens)
    blocks, block_size, hk, d = 64, 16, 3, 64
    before = torch.randn(2, blocks, block_size, hk, d, generator=g).to(cache_dtype)
    qkv = torch.randn(tokens, 4 * hk, d, generator=g).to(model_dtype)
    k, v = qkv[:, 2 * hk : 3 * hk], qkv[:, 3 * hk :]
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    want = before.clone()
    write_kv(want, k, v, slots)
    cache = in_layout(before.clone(), layout)
    ops.write_kv(cache, k, v, slots)
    assert torch.equal(cache, want)
    assert int((cache != before).any(-1).any(-1).sum()) == 2 * tokens  # exactly those slots, both halves


def test_write_kv_refuses_a_slot_outside_the_pool(ops):
    cache = in_layout(torch.zeros(2, 4, 16, 2, 64), "head")
    k = torch.ones(3, 2, 64)
    with pytest.raises(IndexError, match="outside the pool"):
        ops.write_kv(cache, k, k, torch.tensor([0, 5, 64]))
    assert not cache.any()  # the good slots before it are not written either
    with pytest.raises(ValueError, match="keys and values"):
        ops.write_kv(cache, k[:, :1], k[:, :1], torch.tensor([0, 1, 2]))


def test_torch_write_kv_takes_either_layout():
    g = torch.Generator().manual_seed(1)
    want = torch.zeros(2, 8, 4, 2, 32)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    slots = torch.randperm(32, generator=g)[:10]
    write_kv(want, k, v, slots)
    cache = in_layout(torch.zeros(2, 8, 4, 2, 32), "head")
    write_kv(cache, k, v, slots)
    assert torch.equal(cache, want) and want.any()
