"""The Triton kernels (aserve/kernels/triton_attention.py, triton_ops.py) against their
plain-torch twins: without a GPU in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set in conftest.py), in float32 and float16 (the interpreter's
bf16 arithmetic is wrong); with one compiled, on CUDA tensors, in bf16 too. On
tiny shapes: GQA and MQA, sliding windows, soft-capping, contexts split over several
programs, block tables in no order and padded; and a whole tiny model stepped through them
giving the plain path's tokens."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="needs triton (the test extra)")

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.kernels import triton_attention as tk  # noqa: E402
from aserve.kernels.attention import write_kv  # noqa: E402
from aserve.kernels.triton_ops import TritonOps  # noqa: E402

# Where the kernels run: the interpreter takes CPU tensors, compiled kernels CUDA ones.
# Inputs are made on the CPU (one generator, the same values on both) and moved there.
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BS = 16


def tol(dtype: torch.dtype) -> dict:
    if dtype == torch.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)


def dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def paged(num_blocks: int, hk: int, d: int, dtype: torch.dtype, g: torch.Generator, bs: int = BS) -> torch.Tensor:
    return torch.randn(2, num_blocks, bs, hk, d, generator=g).to(dtype)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
              window: int | None, softcap: float | None) -> torch.Tensor:
    """[S, Hq, D] queries at ``q_pos`` over [L, Hk, D] keys at positions 0 .. L-1, in
    float64: causal, optionally windowed and soft-capped."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("shd,hld->hsl", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(keys.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hsl,hld->shd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_store_writes_what_write_kv_writes(dtype):
    g = torch.Generator().manual_seed(0)
    cache = paged(6, 2, 32, dtype, g).zero_()
    twin = cache.clone()
    k, v = torch.randn(9, 2, 32, generator=g), torch.randn(9, 2, 32, generator=g)
    slots = torch.tensor([17, 18, 95, 3, -1, 41, 42, 64, -1])  # -1: padding rows, stored nowhere
    on = dev(cache, k, v, slots)
    tk.store_kv(*on)
    cache = on[0].cpu()
    real = slots >= 0
    write_kv(twin, k[real], v[real], slots[real])
    assert torch.equal(cache, twin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 3.0), (9, 2.0)],
                         ids=["plain", "window", "softcap", "both"])
def test_decode_attention_from_the_block_table(dtype, hq, hk, window, softcap):
    g = torch.Generator().manual_seed(hq * 10 + hk)
    d, num_blocks = 32, 12
    cache = paged(num_blocks, hk, d, dtype, g)
    cache[:, 0] = float("nan")  # no row owns block 0: a kernel reading past a row's blocks gives NaN
    seq_lens = torch.tensor([1, 17, 70, 33])
    # Each row's blocks in no particular order (a table that "wraps" the pool), padded with
    # block 0 to a width past every row's (as a captured decode step's table is), so whole
    # splits of a row hold no keys.
    tables = [[5], [7, 2], [11, 3, 9, 1, 6], [4, 10, 8]]
    table = torch.zeros(4, 9, dtype=torch.int64)
    for row, ids in enumerate(tables):
        table[row, : len(ids)] = torch.tensor(ids)
    q = torch.randn(4, hq, d, generator=g).to(dtype)
    scale = 1 / math.sqrt(d)
    # The launch's own split count, and 3 parts (one of 64 keys, one of the rest, one
    # empty for the 70-token row; empty for the short rows).
    for splits in (None, 3):
        got = tk.decode_attention(*dev(q, cache, table, seq_lens), scale, window=window, softcap=softcap,
                                  num_splits=splits).cpu()
        check_decode(got, q, cache, tables, seq_lens, hk, d, scale, window, softcap, dtype)


def check_decode(got, q, cache, tables, seq_lens, hk, d, scale, window, softcap, dtype):
    for row in range(len(tables)):
        n = int(seq_lens[row])
        blocks = torch.tensor(tables[row])
        keys = cache[0][blocks].reshape(-1, hk, d)[:n]
        values = cache[1][blocks].reshape(-1, hk, d)[:n]
        want = reference(q[row : row + 1], keys, values, torch.tensor([n - 1]), scale, window, softcap)
        assert torch.allclose(got[row].double(), want[0], **tol(dtype)), (row, (got[row].double() - want[0]).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk", [(4, 2), (2, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window, softcap", [(None, None), (11, None), (None, 2.5)], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("bs, d", [(16, 16), (4, 8)], ids=["bs16", "bs4-d8"])
def test_prefill_attention_over_cached_context_and_the_chunk(dtype, hq, hk, window, softcap, bs, d):
    """Blocks of 4 tokens and heads of 8 dims are smaller than a compiled ``tl.dot``
    takes (16): the kernel reads several blocks an iteration and pads the head."""
    g = torch.Generator().manual_seed(7)
    # (context already cached, chunk length): a fresh prompt, a chunk after a prefix
    # hit, a later chunk of a long prompt; each chunk's blocks are taken from the pool in
    # no order.
    sizes = [(0, 21), (19, 7), (40, 30)]
    needed = [-(-(ctx + n) // bs) for ctx, n in sizes]
    order = torch.randperm(sum(needed) + 2, generator=g)[:sum(needed)].tolist()
    chunks, used = [], 0
    for (ctx, n), k in zip(sizes, needed):
        chunks.append((ctx, n, order[used : used + k]))
        used += k
    cache = paged(sum(needed) + 2, hk, d, dtype, g, bs)
    starts, total = [], 0
    for _, n, _ in chunks:
        starts.append(total)
        total += n
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    table = torch.zeros(len(chunks), max(needed) + 1, dtype=torch.int64)
    for row, (_, _, ids) in enumerate(chunks):
        table[row, : len(ids)] = torch.tensor(ids)
    q_on, cache_on, table_on, out_on = dev(q, cache, table, torch.zeros_like(q))
    scale = 0.3
    tk.prefill_attention(q_on, cache_on, out_on, starts, [n for _, n, _ in chunks], [c for c, _, _ in chunks],
                         table_on, scale, window=window, softcap=softcap)
    out = out_on.cpu()
    for (ctx, n, ids), start in zip(chunks, starts):
        blocks = torch.tensor(ids)
        keys = cache[0][blocks].reshape(-1, hk, d)[: ctx + n]
        values = cache[1][blocks].reshape(-1, hk, d)[: ctx + n]
        want = reference(q[start : start + n], keys, values, ctx + torch.arange(n), scale, window, softcap)
        assert torch.allclose(out[start : start + n].double(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_element_wise_kernels_match_torch(dtype):
    ops = TritonOps(interpret=DEVICE.type == "cpu")
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype)
    out, new_res = (t.cpu() for t in ops.rms_norm(*dev(x, w), 1e-6, *dev(res)))
    summed = (x.float() + res.float()).to(dtype)
    assert torch.equal(new_res, summed)
    want = torch.rms_norm(summed.float(), (48,), w.float(), 1e-6)
    assert torch.allclose(out.float(), want, **tol(dtype))
    assert torch.allclose(ops.rms_norm(*dev(x, w), 1e-6)[0].cpu().float(), torch.rms_norm(x.float(), (48,), w.float(), 1e-6),
                          **tol(dtype))
    gate_up = torch.randn(3, 2 * 40, generator=g).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert torch.allclose(ops.silu_mul(*dev(gate_up)).cpu().float(), F.silu(gate) * up, **tol(dtype))
    assert torch.allclose(ops.gelu_tanh_mul(*dev(gate_up)).cpu().float(), F.gelu(gate, approximate="tanh") * up,
                          **tol(dtype))
    q = torch.randn(6, 3, 16, generator=g).to(dtype)
    angles = torch.randn(6, 8, generator=g)
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    x1, x2 = q.float().chunk(2, dim=-1)
    want = torch.cat([x1 * cos.float() - x2 * sin.float(), x2 * cos.float() + x1 * sin.float()], dim=-1)
    assert torch.allclose(ops.rotary_(*dev(q, cos, sin)).cpu().float(), want, **tol(dtype))


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_a_tiny_model_stepped_through_the_triton_kernels_gives_the_plain_tokens(arch, model_dirs, monkeypatch):
    """Greedy tokens through prefill (chunked, after a prefix hit too) and decode: the
    same with every attention, store, norm, rotary and activation on the Triton kernels."""
    prompts = [[(5 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((9, 30, 17))]
    prompts.append(prompts[1][:20] + [4, 5])  # shares two blocks with the second prompt
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory=1 << 22, block_size=16, max_num_batched_tokens=24)
    monkeypatch.setenv("ASERVE_TRITON", "0")  # on a GPU the kernels would serve by default
    with LLM(str(model_dirs[arch]), **kwargs) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setenv("ASERVE_TRITON", "1")
    with LLM(str(model_dirs[arch]), **kwargs) as via_triton:
        assert via_triton.engine.executor.worker.runner.triton_attention
        got = [o.outputs[0].token_ids for o in via_triton.generate(prompts, params)]
    assert got == want


def test_decode_splits_follow_the_batch_not_the_tables_width():
    """The split count fills the GPU's multiprocessors with programs and no more: a
    batch of as many (row, head) pairs as that holds reads each row in one program,
    whatever the width of the (captured) block table; one row splits as far as its
    widest possible context allows."""
    sms = 132
    assert tk.decode_splits(32, 16, 256, 16, 64, sms) == 2  # 512 pairs, 528 programs wanted
    assert tk.decode_splits(64, 16, 256, 16, 64, sms) == 1
    assert tk.decode_splits(1, 16, 256, 16, 64, sms) == 33
    assert tk.decode_splits(1, 16, 4, 16, 64, sms) == 1  # a 64-token table: one tile at most
    assert tk.decode_splits(1, 1, 256, 16, 64, 1) == 4


def test_a_gpu_worker_warns_when_the_interpreter_would_serve(monkeypatch, caplog):
    """TRITON_INTERPRET=1 left in a GPU worker's environment runs every kernel in the
    interpreter on the host: the worker still serves, and says so once at start-up."""
    from aserve.worker.worker import triton_chosen

    monkeypatch.delenv("ASERVE_TRITON", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level("WARNING", logger="aserve.worker"):
        assert triton_chosen(torch.device("cuda"))
    assert any("interpreter" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.delenv("TRITON_INTERPRET")
    with caplog.at_level("WARNING", logger="aserve.worker"):
        assert triton_chosen(torch.device("cuda"))
        assert not triton_chosen(torch.device("cpu"))  # auto: the CPU keeps its own kernels
    assert not caplog.records
