"""The C prefill-attention kernels (aserve/kernels/cpu_prefill_attention.py): causal
attention of prefill chunks in bf16 on AMX or AVX512-BF16, and in float32 in its AVX-512
and AVX2 forms (each where the CPU runs it), fresh or after cached context, against a
float64 reference and torch's SDPA, and their use by paged_attention and the model
runner."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.nn.functional as F

from aserve import LLM, SamplingParams
from aserve.kernels.attention import AttentionMetadata, LayerKV, PrefillChunk, paged_attention
from aserve.envs import read_env
from aserve.kernels.cbuild import load_library
from aserve.kernels.cpu_prefill_attention import _F32_SOURCE, load
from tests.cpu_marks import needs_amx, needs_avx2_fma, needs_avx512_bf16, needs_avx512f, needs_bf16_kernel
from tests.kv_layout import LAYOUTS, in_layout


class Kernel:
    """A loaded kernel and the dtype it takes; calls go to the kernel."""

    def __init__(self, fn, dtype):
        self.fn, self.dtype = fn, dtype

    def __call__(self, *args):
        return self.fn(*args)


@pytest.fixture(scope="module", params=[pytest.param("amx", marks=needs_amx),
                                        pytest.param("avx512_bf16", marks=needs_avx512_bf16),
                                        pytest.param("f32-avx512", marks=needs_avx512f),
                                        pytest.param("f32-avx2", marks=needs_avx2_fma)])
def attend(request):
    """Each form the CPU runs: AMX, the AVX512-BF16 one (which an AMX CPU takes with
    ASERVE_CPU_AMX=0), and float32's AVX-512 and AVX2 forms (the second built with
    -mno-avx512f on an AVX-512 CPU)."""
    if request.param.startswith("f32"):
        flags = ("-mno-avx512f",) if request.param == "f32-avx2" else ()
        kernel = load(torch.float32, flags)
        assert kernel is not None
        # The form under test is the one built: 8 lanes for AVX2, 16 for AVX-512.
        lib = load_library(_F32_SOURCE, read_env().cache_dir / "kernels", "test", flags)
        lib.aserve_prefill_attention_f32_available.restype = ctypes.c_int
        assert lib.aserve_prefill_attention_f32_available() == (8 if flags else 16)
        return Kernel(kernel, torch.float32)
    saved = os.environ.get("ASERVE_CPU_AMX")
    if request.param == "avx512_bf16":
        os.environ["ASERVE_CPU_AMX"] = "0"
    try:
        kernel = load()
    finally:
        if saved is None:
            os.environ.pop("ASERVE_CPU_AMX", None)
        else:
            os.environ["ASERVE_CPU_AMX"] = saved
    assert kernel is not None
    return Kernel(kernel, torch.bfloat16)


def tolerance(dtype, bf16=0.01):
    """The largest error allowed against float64: ``bf16`` for bf16 output (half an ulp
    of values up to ~2 is 0.004, and the kernel rounds its weights to bf16 before the
    second product, as the flash kernel does); float32 keeps every weight in float32."""
    return bf16 if dtype == torch.bfloat16 else 2e-5


def exact(q, k, v, scale, context_k=None, context_v=None):
    """One prompt's causal attention in float64 ([n, H, D] each); keys and values after
    any cached context."""
    if context_k is not None:
        k, v = torch.cat([context_k, k]), torch.cat([context_v, v])
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    n, total = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.arange(total) > (total - n + torch.arange(n)).unsqueeze(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def sdpa(q, k, v, scale):
    heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*heads, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens,hq,hk,d", [
    ([128, 128, 128], 4, 2, 64),      # the 7M model's shape
    ([1, 15, 16, 17, 31, 32, 33, 48, 70], 4, 4, 64),  # lengths around the 16-row and 32-key blocks
    ([40, 9], 8, 1, 32),              # eight query heads on one KV head
    ([57], 8, 2, 128),
    ([300], 2, 2, 256),
    ([600, 257], 4, 2, 64),           # several 256-key steps of the online softmax
    ([256, 529], 2, 1, 64),           # a prompt of one whole key chunk, one past two
])
def test_matches_the_exact_result_as_closely_as_sdpa(attend, set_threads, threads, lens, hq, hk, d):
    set_threads(threads)
    g = torch.Generator().manual_seed(sum(lens) + d)
    total = sum(lens) + 3
    # q, k and v as views of one projection output, tokens strided as in the model.
    qkv = torch.randn(total, (hq + 2 * hk) * d, generator=g).to(attend.dtype)
    q = qkv[:, : hq * d].view(total, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(total, hk, d)
    v = qkv[:, (hq + hk) * d :].view(total, hk, d)
    starts = [2 + sum(lens[:i]) for i in range(len(lens))]  # rows 0-1 and the last belong to no prompt
    out = torch.full((total, hq, d), 7.0, dtype=attend.dtype)
    scale = d**-0.5
    attend(q, k, v, out, starts, lens, scale)
    for s, n in zip(starts, lens):
        want = exact(q[s : s + n], k[s : s + n], v[s : s + n], scale)
        err = (out[s : s + n].double() - want).abs().max().item()
        sdpa_err = (sdpa(q[s : s + n], k[s : s + n], v[s : s + n], scale).double() - want).abs().max().item()
        assert err <= tolerance(attend.dtype, max(1.5 * sdpa_err, 0.008)), (s, n, err, sdpa_err)
    for row in (0, 1, total - 1):
        assert torch.all(out[row] == 7.0)  # rows outside the prompts untouched


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunks_after_cached_context_read_the_paged_cache(attend, set_threads, threads, layout):
    set_threads(threads)
    g = torch.Generator().manual_seed(11)
    hq, hk, d, block, num_blocks = 8, 2, 64, 16, 128
    # (cached tokens, chunk tokens): around block and tile edges, across the kernels'
    # 256-key chunks, and one fresh prompt.
    chunks = [(1, 1), (15, 2), (16, 17), (33, 40), (100, 5), (0, 9), (250, 20), (240, 33), (512, 3)]
    cache = in_layout(torch.randn(2, num_blocks, block, hk, d, generator=g).to(attend.dtype), layout)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # each request's blocks scattered, block 0 unused
    total = sum(n for _, n in chunks)
    q = torch.randn(total, hq, d, generator=g).to(attend.dtype)
    k, v = torch.empty(total, hk, d, dtype=attend.dtype), torch.empty(total, hk, d, dtype=attend.dtype)
    starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    tables, used = [], 0
    width = max(-(-(c + n) // block) for c, n in chunks)
    for (c, n), start in zip(chunks, starts):
        blocks = perm[used : used + -(-(c + n) // block)]
        used += blocks.numel()
        # The chunk's own keys and values are in its rows and, as the model writes them
        # before attending, in the cache at positions c .. c + n - 1.
        for t in range(n):
            b, off = blocks[(c + t) // block], (c + t) % block
            k[start + t], v[start + t] = cache[0, b, off], cache[1, b, off]
        tables.append(torch.cat([blocks, torch.zeros(width - blocks.numel(), dtype=torch.int64)]))
    out = torch.zeros(total, hq, d, dtype=attend.dtype)
    scale = d**-0.5
    attend(q, k, v, out, starts, [n for _, n in chunks], scale,
           ([c for c, _ in chunks], torch.stack(tables), cache[0], cache[1]))
    for (c, n), s, table in zip(chunks, starts, tables):
        rows = torch.tensor([int(table[t // block]) * block + t % block for t in range(c)], dtype=torch.int64)
        ctx_k = cache[0].reshape(-1, hk, d)[rows] if c else None
        ctx_v = cache[1].reshape(-1, hk, d)[rows] if c else None
        want = exact(q[s : s + n], k[s : s + n], v[s : s + n], scale, ctx_k, ctx_v)
        err = (out[s : s + n].double() - want).abs().max().item()
        assert err < tolerance(attend.dtype), (c, n, err)


def test_a_maximum_that_grows_chunk_after_chunk(attend, set_threads):
    """Keys whose scores grow with their position: each later key chunk raises every
    row's maximum, so the output and sum so far are rescaled again and again (the online
    softmax), and the later keys dominate; against float64."""
    set_threads(1)
    g = torch.Generator().manual_seed(3)
    n, hq, hk, d = 900, 2, 1, 64
    u = torch.randn(d, generator=g)
    u *= 3 / u.norm()  # queries and keys share this direction, keys more of it the later they come
    q = torch.randn(n, hq, d, generator=g) * 0.5 + u
    k = torch.randn(n, hk, d, generator=g) * 0.3 + u * torch.linspace(0, 6, n).view(n, 1, 1)
    v = torch.randn(n, hk, d, generator=g)
    q, k, v = (t.to(attend.dtype) for t in (q, k, v))
    out = torch.empty(n, hq, d, dtype=attend.dtype)
    attend(q, k, v, out, [0], [n], d**-0.5)
    want = exact(q, k, v, d**-0.5)
    weights = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hk, 1))
    assert weights[:, -1, -256:].max() > weights[:, -1, :256].max() + 10  # the last chunk's scores lead by far
    assert (out.double() - want).abs().max().item() < tolerance(attend.dtype)


def test_a_chunk_far_above_the_maximum_so_far(attend, set_threads):
    """Keys from 600 on score ~1,000 above the ones before (2^190 in weight, past
    float32): the AMX kernel, which weighs a chunk against the maximum of the chunks
    before while the chunk rises less than 2^16 above it, must find this chunk's maximum
    and rescale; against float64 (an overflow would give inf or NaN)."""
    set_threads(1)
    g = torch.Generator().manual_seed(4)
    n, hq, hk, d = 900, 2, 1, 64
    u = torch.randn(d, generator=g)
    u *= 6 / u.norm()
    q = torch.randn(n, hq, d, generator=g) * 0.5 + u
    k = torch.randn(n, hk, d, generator=g) * 0.3 + u * (torch.arange(n) >= 600).float().mul(30).view(n, 1, 1)
    v = torch.randn(n, hk, d, generator=g)
    q, k, v = (t.to(attend.dtype) for t in (q, k, v))
    out = torch.empty(n, hq, d, dtype=attend.dtype)
    attend(q, k, v, out, [0], [n], d**-0.5)
    want = exact(q, k, v, d**-0.5)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hk, 1)) * d**-0.5
    assert (scores[:, 700, 600:701].max(-1).values - scores[:, 700, :512].max(-1).values).min() > 100
    assert torch.isfinite(out).all()
    # float32 scores near 1,000 carry ~6e-5 of rounding, which the weights inherit.
    assert (out.double() - want).abs().max().item() < tolerance(attend.dtype) * (1 if attend.dtype == torch.bfloat16 else 5)


def test_the_same_bits_for_any_thread_count(attend, set_threads):
    """Each query row is one work item's, summed in a fixed order: the thread count does
    not change a bit (what TP ranks and repeated runs rely on)."""
    g = torch.Generator().manual_seed(5)
    lens, hq, hk, d = [300, 47, 129], 8, 2, 64
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(attend.dtype) for h in (hq, hk, hk))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    outs = []
    for threads in (1, 2):
        set_threads(threads)
        out = torch.empty(total, hq, d, dtype=attend.dtype)
        attend(q, k, v, out, starts, lens, d**-0.5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_a_build_without_the_instructions_is_not_loaded():
    """cbuild.load_library's ``available`` check: built without AVX2, FMA and AVX-512 the
    float32 kernel says so (0 lanes), and the loader gives None, never a stub that fails
    on every call."""
    cache, flags = read_env().cache_dir / "kernels", ("-mno-avx512f", "-mno-avx2", "-mno-fma")
    lib = load_library(_F32_SOURCE, cache, "test", flags)
    assert lib is not None
    lib.aserve_prefill_attention_f32_available.restype = ctypes.c_int
    assert lib.aserve_prefill_attention_f32_available() == 0
    assert load_library(_F32_SOURCE, cache, "test", flags, available="aserve_prefill_attention_f32_available") is None


def test_refuses_shapes_it_does_not_take(attend):
    other = torch.float32 if attend.dtype == torch.bfloat16 else torch.bfloat16
    multiple = 32 if attend.dtype == torch.bfloat16 else 16
    q = torch.zeros(4, 2, multiple + 8, dtype=attend.dtype)
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        attend(q, q, q, torch.empty_like(q), [0], [4], 1.0)
    q = torch.zeros(4, 2, 32, dtype=other)
    with pytest.raises(ValueError):
        attend(q, q, q, torch.empty_like(q), [0], [4], 1.0)
    q = torch.zeros(4, 2, 32, dtype=attend.dtype)
    with pytest.raises(ValueError, match="past the batch"):
        attend(q, q, q, torch.empty_like(q), [2], [3], 1.0)
    cache = torch.zeros(2, 4, 4, 2, 32, dtype=other)
    with pytest.raises(ValueError, match="cache halves"):
        attend(q, q, q, torch.empty_like(q), [0], [4], 1.0, ([1], torch.ones(1, 2, dtype=torch.int64), *cache))


def test_paged_attention_sends_every_prefill_chunk_to_the_kernel(attend):
    g = torch.Generator().manual_seed(3)
    hq, hk, d, block = 4, 2, 32, 4
    chunks = (PrefillChunk(0, 6, 0, None), PrefillChunk(6, 9, 4, torch.tensor([1, 2])), PrefillChunk(9, 20, 0, None))
    total = 20
    q, k, v = (torch.randn(total, h, d, generator=g).to(attend.dtype) for h in (hq, hk, hk))
    cache = torch.zeros(2, 16, block, hk, d, dtype=attend.dtype)
    context = torch.randn(2, 4, hk, d, generator=g).to(attend.dtype)
    cache[:, 1] = context  # block 1: the 4 cached tokens of the second chunk
    slots = torch.arange(total) + 3 * block
    slots[6:9] = torch.arange(2 * block, 2 * block + 3)  # the chunk continues in block 2
    calls = []

    def spy(*args):
        calls.append((list(args[4]), list(args[5]), list(args[7][0])))
        attend(*args)

    meta = AttentionMetadata(slots, 0, None, None, chunks, prefill_kernel=spy)
    got = paged_attention(q, k, v, LayerKV(cache), meta, d**-0.5)
    assert calls == [([0, 6, 9], [6, 3, 11], [0, 4, 0])]  # one call; the second chunk after 4 cached tokens
    for c in chunks:
        ctx = (context[0], context[1]) if c.block_ids is not None else (None, None)
        want = exact(q[c.start : c.end], k[c.start : c.end], v[c.start : c.end], d**-0.5, *ctx)
        assert (got[c.start : c.end].double() - want).abs().max().item() < tolerance(attend.dtype)


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([entry[prompt[pos]].logprob for pos, entry in enumerate(out.prompt_logprobs[1:], start=1)])


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16_kernel),
                                   pytest.param("float32", marks=needs_avx2_fma)])
def test_the_runner_uses_it_and_agrees_with_sdpa(llama_dir, monkeypatch, dtype):
    prompt = [(7 * i + 3) % 200 + 10 for i in range(45)]
    llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory=1 << 24)
    runner = llm.engine.executor.worker.runner
    assert runner.prefill_kernel is not None
    calls = []
    kernel = runner.prefill_kernel
    runner.prefill_kernel = lambda *a: calls.append(a[5]) or kernel(*a)
    with_kernel = _prompt_logprobs(llm, prompt)
    assert calls and all(lens == [45] for lens in calls)  # once a layer, the whole prompt
    monkeypatch.setenv("ASERVE_CPU_ATTENTION", "sdpa")
    plain = LLM(str(llama_dir), dtype=dtype, kv_cache_memory=1 << 24)
    assert plain.engine.executor.worker.runner.prefill_kernel is None
    assert (with_kernel - _prompt_logprobs(plain, prompt)).abs().max().item() < (0.05 if dtype == "bfloat16" else 1e-4)


@needs_avx2_fma
def test_not_loaded_for_a_cache_of_another_dtype(llama_dir):
    """A float32 model over a bf16 cache keeps SDPA: each kernel reads a cache of its own dtype."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=1 << 24)
    assert llm.engine.executor.worker.runner.prefill_kernel is None
