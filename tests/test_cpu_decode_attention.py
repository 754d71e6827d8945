"""The C decode-attention kernel against SDPA, and the plain-torch path it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aserve import LLM, SamplingParams
from aserve.envs import read_env
from aserve.kernels import cpu_decode_attention
from tests.cpu_marks import needs_amx, needs_avx2_fma, needs_avx512_bf16
from tests.kv_layout import LAYOUTS, in_layout

#: Compiler flags that build the kernel's AVX512-BF16 form of the shared prefix's products
#: on a CPU that also has AMX (elsewhere they change nothing).
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@pytest.fixture(scope="module")
def attend():
    kernel = cpu_decode_attention.load()
    assert kernel is not None, "the kernel must build on these machines (gcc is part of the setup)"
    return kernel


@pytest.fixture(scope="module")
def attend_avx2():
    """The kernel built as for a CPU without AVX-512 (vectors of 8)."""
    kernel = cpu_decode_attention.load(("-mno-avx512f",))
    assert kernel is not None
    return kernel


def reference(q, keys, values, block_table, seq_lens, scale):
    """SDPA over each sequence's gathered blocks, in float32."""
    block_size = keys.shape[1]
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = block_table[b, : -(-n // block_size)]
        k = keys[blocks].flatten(0, 1)[:n].transpose(0, 1).float()  # [Hk, n, D]
        v = values[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        outs.append(F.scaled_dot_product_attention(q[b].unsqueeze(1).float(), k, v, scale=scale,
                                                   enable_gqa=True).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("batch,hq,hk,dim,block_size", [
    (1, 4, 2, 64, 16),     # one sequence: the heads are split between threads
    (7, 4, 2, 64, 16),     # grouped-query attention
    (32, 16, 16, 64, 16),  # the 152M benchmark's shape
    (3, 8, 1, 128, 8),     # one KV head, head_dim 128, small blocks
    (4, 6, 3, 32, 16),     # a head_dim without its own specialisation
    (2, 126, 3, 32, 16),   # more query heads than one task holds: split by KV heads
    (3, 4, 2, 48, 16),     # head_dim 48: whole AVX2 vectors, but not whole AVX-512 bf16 pairs
    (3, 4, 2, 36, 16),     # no whole vectors: the portable C loop
    (2, 16, 2, 32, 16),    # 8 query heads per KV head, taken in one group
    (3, 3, 1, 64, 16),     # 3 query heads per KV head: groups of one
])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["native", pytest.param("avx2", marks=needs_avx2_fma)])
def test_matches_sdpa(request, attend, dtype, tol, batch, hq, hk, dim, block_size, threads, layout, form):
    """Each shape on this CPU's build and, where it can run, the AVX2 one (vectors of 8,
    which take a 16-token block's rows of a head in two: cpu_decode_attention.c's SPAN)."""
    if form == "avx2":
        attend = request.getfixturevalue("attend_avx2")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(batch * 1000 + dim)
        num_blocks = 64
        cache = in_layout(torch.randn(2, num_blocks, block_size, hk, dim, generator=gen).to(dtype), layout)
        # q as the model passes it: a strided slice of the projected q/k rows.
        q = torch.randn(batch, hq + hk, dim, generator=gen).to(dtype)[:, :hq]
        # Lengths of 1, exact multiples of the block size, and ragged ones.
        seq_lens = torch.tensor([[1, block_size, 3 * block_size, 5 * block_size - 3, 37][i % 5] for i in range(batch)])
        max_blocks = int(-(-seq_lens.max() // block_size)) + 1  # one padding column
        block_table = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:max_blocks] + 1 for _ in range(batch)])
        out = attend(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5)
        assert out.dtype == dtype and out.shape == (batch, hq, dim)
        expected = reference(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_long_sequences_cross_chunks(attend, dtype, tol):
    # The kernel takes a sequence 256 tokens at a time and rescales its running sums
    # between chunks: lengths around and over that, with sharp scores (a large scale)
    # so that a later chunk's maximum differs from an earlier one's.
    gen = torch.Generator().manual_seed(7)
    block_size, hq, hk, dim = 16, 8, 2, 64
    seq_lens = torch.tensor([255, 256, 257, 700, 1])
    max_blocks = int(-(-seq_lens.max() // block_size))
    num_blocks = len(seq_lens) * max_blocks + 1
    cache = torch.randn(2, num_blocks, block_size, hk, dim, generator=gen).to(dtype)
    q = (torch.randn(len(seq_lens), hq, dim, generator=gen) * 4).to(dtype)
    block_table = torch.randperm(num_blocks - 1, generator=gen)[: len(seq_lens) * max_blocks].view(len(seq_lens), -1) + 1
    out = attend(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5)
    expected = reference(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_rejects_other_dtypes_and_layouts(attend):
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)
    q = torch.zeros(1, 2, 64, dtype=torch.float16)
    table, lens = torch.ones(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        attend(q, cache[0], cache[1], table, lens, 0.125)
    cache = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="one layout"):  # keys token by token, values head by head
        attend(q.float(), cache[0], in_layout(cache, "head")[1], table, lens, 0.125)
    with pytest.raises(ValueError, match="rows contiguous"):
        attend(q.float(), cache[0].transpose(2, 3), cache[1].transpose(2, 3), table, lens, 0.125)
    with pytest.raises(TypeError, match="int64"):
        attend(q.float(), cache[0], cache[1], table.int(), lens, 0.125)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_ATTENTION", "sdpa")
    assert cpu_decode_attention.load() is None


def test_plain_torch_path_gives_the_kernels_tokens(monkeypatch, llama_dir):
    """The fallback (dense staging + SDPA) and the kernel decode the same greedy tokens,
    with requests of different lengths finishing at different steps."""
    prompts = [[5, 9, 14, 3], list(range(10, 50)), [7] * 19]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21)]
    kernel_llm = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    assert kernel_llm.engine.executor.worker.runner.decode_kernel is not None
    with_kernel = kernel_llm.generate(prompts, params)
    monkeypatch.setenv("ASERVE_CPU_ATTENTION", "sdpa")
    llm = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    assert llm.engine.executor.worker.runner.decode_kernel is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in with_kernel]


def test_the_cpu_pool_is_head_major_and_either_write_gives_the_same_tokens(monkeypatch, llama_dir):
    """The runner's CPU pool keeps each block KV head by KV head, written by the C write
    (FusedOps.write_kv) or, with the fused kernels off, by torch's index_put_: the same
    greedy tokens, prefills in chunks (later chunks read what earlier ones wrote)."""
    prompts = [list(range(3, 60)), [7] * 19]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("ASERVE_CPU_FUSED_OPS", fused)
        llm = LLM(str(llama_dir), kv_cache_memory=1 << 24, max_num_batched_tokens=16)
        runner = llm.engine.executor.worker.runner
        paged = runner.kv_caches[0].paged
        _, _, block_size, hk, d = paged.shape
        assert paged.stride()[2:] == (d, block_size * d, 1)  # token, head, element
        assert (runner.kv_writer is not None) == (fused == "1")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_writes_the_new_tokens_before_attending(attend, dtype, layout):
    gen = torch.Generator().manual_seed(7)
    batch, hq, hk, dim, block_size = 5, 4, 2, 64, 16
    cache = in_layout(torch.randn(2, 32, block_size, hk, dim, generator=gen).to(dtype), layout)
    seq_lens = torch.tensor([1, 16, 17, 40, 33])
    block_table = torch.stack([torch.randperm(31, generator=gen)[:4] + 1 for _ in range(batch)])
    q = torch.randn(batch, hq, dim, generator=gen).to(dtype)
    kv = torch.randn(batch, 2 * hk, dim, generator=gen).to(dtype)  # strided halves, as the model's
    new_k, new_v = kv[:, :hk], kv[:, hk:]
    expected_cache = cache.clone()
    for b in range(batch):
        pos = int(seq_lens[b]) - 1
        block = int(block_table[b, pos // block_size])
        expected_cache[0, block, pos % block_size] = new_k[b]
        expected_cache[1, block, pos % block_size] = new_v[b]
    out = attend(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5, new_k, new_v)
    assert torch.equal(cache, expected_cache)  # exactly those slots changed
    expected = reference(q, expected_cache[0], expected_cache[1], block_table, seq_lens, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="both"):
        attend(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5, new_k, None)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("dim", [64, 36])  # a vector path, and the portable loop
@pytest.mark.parametrize("threads", [1, 2])
def test_cache_in_another_dtype_than_the_queries(attend, q_dtype, kv_dtype, dim, threads):
    """``--kv-cache-dtype``: the new keys and values are rounded into the cache's dtype,
    and the output, in the queries' dtype, is attention over the cache as it is stored."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11 + dim)
        batch, hq, hk, block_size = 6, 4, 2, 16
        cache = torch.randn(2, batch * 19 + 1, block_size, hk, dim, generator=gen).to(kv_dtype)
        seq_lens = torch.tensor([1, 16, 17, 40, 33, 300])
        # No block in two rows: a row's new token must not land in another row's keys.
        block_table = torch.randperm(batch * 19, generator=gen).view(batch, 19) + 1
        q = torch.randn(batch, hq, dim, generator=gen).to(q_dtype)
        kv = torch.randn(batch, 2 * hk, dim, generator=gen).to(q_dtype)
        new_k, new_v = kv[:, :hk], kv[:, hk:]
        expected_cache = cache.clone()
        for b in range(batch):
            pos = int(seq_lens[b]) - 1
            block = int(block_table[b, pos // block_size])
            expected_cache[0, block, pos % block_size] = new_k[b].to(kv_dtype)
            expected_cache[1, block, pos % block_size] = new_v[b].to(kv_dtype)
        out = attend(q, cache[0], cache[1], block_table, seq_lens, dim**-0.5, new_k, new_v)
        assert out.dtype == q_dtype and out.shape == (batch, hq, dim)
        assert torch.equal(cache, expected_cache)
        expected = reference(q, expected_cache[0], expected_cache[1], block_table, seq_lens, dim**-0.5)
        tol = 1e-5 if q_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(old)


def _shared_prefix_case(gen, batch, hk, dim, block_size, prefix_blocks, dtype, spread=40):
    """A cache where every row's first ``prefix_blocks`` blocks are the same blocks, then
    blocks of its own, with contexts ending 1 to ``spread`` tokens past the prefix."""
    own = -(-spread // block_size) + 1
    cache = torch.randn(2, 1 + prefix_blocks + batch * own, block_size, hk, dim, generator=gen).to(dtype)
    table = torch.zeros(batch, prefix_blocks + own, dtype=torch.int64)
    table[:, :prefix_blocks] = torch.randperm(prefix_blocks, generator=gen) + 1  # any order of blocks
    table[:, prefix_blocks:] = (1 + prefix_blocks + torch.randperm(batch * own, generator=gen)).view(batch, own)
    seq_lens = torch.tensor([prefix_blocks * block_size + 1 + (7 * b) % spread for b in range(batch)])
    return cache, table, seq_lens


@pytest.mark.parametrize("batch,hq,hk,dim,block_size,prefix_blocks", [
    (32, 16, 16, 64, 16, 8),   # the 152M model's heads, 128 shared tokens
    (20, 4, 2, 64, 16, 9),     # grouped-query attention: 40 rows a KV head, a last block of 8 rows
    (9, 8, 1, 128, 16, 5),     # one KV head, head_dim 128, an odd number of 16-key blocks
    (12, 4, 2, 32, 32, 3),     # blocks of 32 tokens, head_dim 32
    (10, 4, 4, 64, 8, 12),     # blocks of 8: keys laid out one by one
    (16, 4, 4, 64, 8, 5),      # 40 tokens, not whole 16-key blocks: the vector path takes it all
    (3, 4, 2, 64, 16, 8),      # 6 rows a KV head: too few to pay for the prefix's products
])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", ["native", pytest.param("avx512_bf16", marks=needs_avx512_bf16),
                                  pytest.param("avx2", marks=needs_avx2_fma), "portable"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix_matches_sdpa(attend, form, batch, hq, hk, dim, block_size, prefix_blocks, threads,
                                    set_threads, layout):
    """Rows whose first blocks are the same (``prefix_blocks``): the result is still each
    row's attention over its whole context, new keys and values written first, on every
    CPU (with AMX or AVX512-BF16 the prefix is attended for all rows at once as matrix
    products, elsewhere row by row). ``avx512_bf16``: that form built without AMX;
    ``avx2`` and ``portable``: the kernel built as for a CPU without AVX-512 (or without
    AVX2 either), where the prefix is an ordinary part of each row's context."""
    if form != "native":
        attend = cpu_decode_attention.load({"avx512_bf16": NO_AMX, "avx2": ("-mno-avx512f",),
                                            "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}[form])
        assert attend is not None
    set_threads(threads)
    gen = torch.Generator().manual_seed(batch + prefix_blocks)
    cache, table, seq_lens = _shared_prefix_case(gen, batch, hk, dim, block_size, prefix_blocks, torch.bfloat16)
    cache = in_layout(cache, layout)
    q = (torch.randn(batch, hq + 2 * hk, dim, generator=gen) * 2).to(torch.bfloat16)
    new_k, new_v = q[:, hq : hq + hk], q[:, hq + hk :]
    expected_cache = cache.clone()
    for b in range(batch):
        pos = int(seq_lens[b]) - 1
        expected_cache[0, table[b, pos // block_size], pos % block_size] = new_k[b]
        expected_cache[1, table[b, pos // block_size], pos % block_size] = new_v[b]
    out = attend(q[:, :hq], cache[0], cache[1], table, seq_lens, dim**-0.5, new_k, new_v, prefix_blocks=prefix_blocks)
    assert torch.equal(cache, expected_cache)
    expected = reference(q[:, :hq], cache[0], cache[1], table, seq_lens, dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("form", [pytest.param("amx", marks=needs_amx),
                                  pytest.param("avx512_bf16", marks=needs_avx512_bf16)])
def test_shared_prefix_attended_as_matrix_products(form):
    """With AMX, or AVX512-BF16 without it, the prefix's part comes from matrix products
    whose softmax weights are rounded to bf16: the output differs from the row-by-row
    path's in its last bits, and is as close to SDPA's."""
    attend = cpu_decode_attention.load(() if form == "amx" else NO_AMX)
    gen = torch.Generator().manual_seed(3)
    cache, table, seq_lens = _shared_prefix_case(gen, 16, 4, 64, 16, 16, torch.bfloat16)
    q = torch.randn(16, 8, 64, generator=gen).to(torch.bfloat16)
    expected = reference(q, cache[0], cache[1], table, seq_lens, 0.125)
    by_rows = attend(q, cache[0], cache[1], table, seq_lens, 0.125)
    on_tiles = attend(q, cache[0], cache[1], table, seq_lens, 0.125, prefix_blocks=16)
    assert not torch.equal(on_tiles, by_rows)
    for out in (by_rows, on_tiles):
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("form", [pytest.param("amx", marks=needs_amx),
                                  pytest.param("avx512_bf16", marks=needs_avx512_bf16)])
def test_kept_prefix_layouts_are_read_back_until_their_state_is_zeroed(form):
    """A prefix slot (PrefixLayouts): the first call lays the prefix out there and sets
    the state; later calls read it back and give the same bits as laying it out afresh.
    While the state says 1 the kernel trusts the slot (keys changed under it are not
    seen: the runner's job, PrefixLayouts.written); zeroed, it lays them out again."""
    attend = cpu_decode_attention.load(() if form == "amx" else NO_AMX)
    gen = torch.Generator().manual_seed(5)
    batch, hq, hk, dim, block_size, prefix_blocks = 12, 8, 2, 64, 16, 6
    cache, table, seq_lens = _shared_prefix_case(gen, batch, hk, dim, block_size, prefix_blocks, torch.bfloat16)
    q = torch.randn(batch, hq, dim, generator=gen).to(torch.bfloat16)
    layouts = cpu_decode_attention.PrefixLayouts(1, hk, dim)
    slot = layouts.for_step(table[0, :prefix_blocks].numpy(), block_size)[0]

    def call(with_slot=True):
        return attend(q, cache[0], cache[1], table, seq_lens, 0.125, prefix_blocks=prefix_blocks,
                      prefix_slot=slot if with_slot else None)

    afresh = call(False)
    assert int(slot[1]) == 0
    assert torch.equal(call(), afresh) and int(slot[1]) == 1  # laid out into the slot
    assert torch.equal(call(), afresh)  # read back
    cache[0, int(table[0, 0])] += 1.0  # the prefix's first block's keys change under the kept layouts
    changed = call(False)
    assert not torch.equal(changed, afresh)
    assert torch.equal(call(), afresh)  # the state still says 1: the old layouts
    slot[1].zero_()
    assert torch.equal(call(), changed) and int(slot[1]) == 1
    with pytest.raises(ValueError, match="prefix_slot"):
        attend(q, cache[0], cache[1], table, seq_lens, 0.125, prefix_blocks=prefix_blocks,
               prefix_slot=(slot[0][:100], slot[1]))


def test_prefix_layouts_are_dropped_when_the_blocks_change_or_are_written():
    layouts = cpu_decode_attention.PrefixLayouts(3, 2, 64, max_bytes=3 * 2 * 128 * 64 * 4)
    blocks = np.array([4, 9, 2, 7, 5, 11, 3, 8])  # 128 tokens of 16
    slots = layouts.for_step(blocks, 16)
    assert len(slots) == 3 and all(s[0].numel() == 2 * 128 * 64 * 4 for s in slots)
    layouts.states.fill_(1)  # as the kernel leaves them
    layouts.for_step(blocks.copy(), 16)
    assert layouts.states.tolist() == [1, 1, 1]  # the same blocks: kept
    layouts.written(np.array([16, 100, 199]), 16)  # slots in blocks 1, 6 and 12
    layouts.for_step(blocks, 16)
    assert layouts.states.tolist() == [1, 1, 1]  # none of them written
    layouts.written(np.array([17, 115]), 16)  # block 7 written: it was freed and holds other keys now
    layouts.for_step(blocks, 16)
    assert layouts.states.tolist() == [0, 0, 0]
    layouts.states.fill_(1)
    layouts.for_step(blocks[:6], 16)  # other blocks
    assert layouts.states.tolist() == [0, 0, 0]
    assert layouts.for_step(np.arange(1, 10), 16) is None  # 144 tokens: over max_bytes


def test_shared_prefix_blocks():
    table = np.array([[4, 7, 9, 1, 0], [4, 7, 9, 2, 3], [4, 7, 9, 5, 6]])
    lens = np.array([60, 80, 70])
    assert cpu_decode_attention.shared_prefix_blocks(table, lens, 16) == 3
    # A row whose newest token is in the third block: only the first two lie before it.
    assert cpu_decode_attention.shared_prefix_blocks(table, np.array([60, 80, 33]), 16) == 2
    assert cpu_decode_attention.shared_prefix_blocks(table, np.array([60, 80, 32]), 16) == 1
    assert cpu_decode_attention.shared_prefix_blocks(table[:1], lens[:1], 16) == 0  # one row
    table[2, 0] = 8
    assert cpu_decode_attention.shared_prefix_blocks(table, lens, 16) == 0
    same = np.array([[1, 2], [1, 2]])
    assert cpu_decode_attention.shared_prefix_blocks(same, np.array([33, 40]), 16) == 2


def test_prefix_supported_for_bf16_on_amx_or_avx512_bf16():
    amx = frozenset({"avx512f", "amx_tile", "amx_bf16"})
    bf16, f32 = torch.bfloat16, torch.float32
    env = read_env({})
    assert cpu_decode_attention.prefix_supported(bf16, bf16, amx, env)
    assert not cpu_decode_attention.prefix_supported(bf16, f32, amx, env)  # a bf16 cache under float32
    assert not cpu_decode_attention.prefix_supported(f32, f32, amx, env)
    zen4 = frozenset({"avx512f", "avx512_bf16"})
    assert cpu_decode_attention.prefix_supported(bf16, bf16, zen4, env)
    assert not cpu_decode_attention.prefix_supported(bf16, bf16, frozenset({"avx512f", "avx2"}), env)
    for var in ("ASERVE_CPU_DECODE_PREFIX", "ASERVE_CPU_AMX"):
        assert not cpu_decode_attention.prefix_supported(bf16, bf16, amx, read_env({var: "0"}))
    assert not cpu_decode_attention.prefix_supported(bf16, bf16, zen4, read_env({"ASERVE_CPU_DECODE_PREFIX": "0"}))
    assert cpu_decode_attention.prefix_supported(bf16, bf16, zen4, read_env({"ASERVE_CPU_AMX": "0"}))
