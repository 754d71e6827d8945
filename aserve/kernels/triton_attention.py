"""Paged attention and the KV-cache store in Triton, behind the contract of
:func:`aserve.kernels.attention.paged_attention` (the plain-torch path is their twin).

Layout, as every reader in aserve indexes it: one layer's cache is ``[2, num_blocks,
block_size, Hk, D]`` (keys, values), here one contiguous tensor (the CPU pool stores each
block head-major under the same shape: :func:`aserve.kernels.attention.head_major`); token
``t`` of a request lives at slot ``block_table[t // bs] * bs + t % bs``. The kernels:

- :func:`store_kv`: a step's keys and values to their slots (one program a token).
- :func:`decode_attention`: one query a row straight from the block table, each row's
  context split into parts (a program each, online softmax over tiles of several cache
  blocks), then one program a (row, head) merges the parts. The split count follows the
  batch: a small batch splits its rows so a long context keeps every multiprocessor busy;
  a batch of as many (row, head) pairs as the GPU holds programs takes one part each.
  GQA/MQA by head index; a sliding window (the last ``window`` positions) and logit
  soft-capping where a layer has them.
- :func:`prefill_attention`: every prefill chunk of a step, variable lengths, each query
  over its request's cached context and the chunk's own earlier tokens (causal), from the
  paged cache (the store runs first). A program takes ``BLOCK_M`` queries of one chunk and
  one head.

Arithmetic is float32 whatever the inputs' dtype (loads are upcast). On CPU tensors they
run in Triton's interpreter (``TRITON_INTERPRET=1`` set before import: the tests where no
GPU is visible); its bf16 arithmetic is wrong, so those tests use float32 and float16. On
a GPU they are compiled (the tests take bf16 too), and tests/triton_compile.py compiles
each for sm_90 and sm_80 without one, since the interpreter does not refuse what the
compiler does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# A constexpr: a kernel may read no other kind of global (the compiler refuses it; the
# interpreter does not check).
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slots_ptr, stride_kt, stride_vt, stride_side, stride_slot,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < tl.where(slot >= 0, WIDTH, 0)  # slot -1: a padding row (CUDA graphs), stored nowhere
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    tl.store(cache_ptr + slot * stride_slot + cols, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_side + slot * stride_slot + cols, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``k``, ``v`` [T, Hk, D] into ``kv_cache`` [2, blocks, bs, Hk, D] at ``slot_mapping``
    [T] (rounded to the cache's dtype), as :func:`aserve.kernels.attention.write_kv`; a
    token whose slot is -1 is not stored (the padding rows of a captured decode step)."""
    tokens, hk, d = k.shape
    if tokens == 0:
        return
    assert kv_cache.is_contiguous() and k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
    width = hk * d
    _store_kv_kernel[(tokens,)](k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0), width,
                                WIDTH=width, BLOCK=triton.next_power_of_2(width))


@triton.jit
def _decode_part_kernel(q_ptr, cache_ptr, table_ptr, lens_ptr, part_ml_ptr, part_acc_ptr, scale, window, softcap,
                        stride_qn, stride_qh, stride_side, stride_block, stride_tok, stride_head, stride_tn,
                        num_splits, num_heads, GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + n)
    kvh = h // GROUP
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    q = tl.load(q_ptr + n * stride_qn + h * stride_qh + dims, mask=dmask, other=0.0).to(tl.float32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    m_i = tl.full((), NEG_INF, tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    # The row's own share of its keys: its length over the splits, in whole BLOCK_N
    # tiles. The split count is the launch's (fixed in a CUDA graph), the share the
    # row's, so a short row (or a padding row of a captured step) leaves its later
    # splits empty and reads nothing past its end, however wide the block table is.
    share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    begin = s * share
    end = tl.minimum(begin + share, seq_len)
    if HAS_WINDOW:
        begin = tl.maximum(begin, first // BLOCK_N * BLOCK_N)
    for first_key in range(begin, end, BLOCK_N):
        # BLOCK_N keys an iteration, each through its own block id (several cache blocks
        # a tile: fewer, longer iterations than one block each).
        pos = first_key + tl.arange(0, BLOCK_N)
        visible = (pos < end) & (pos >= first)
        block_id = tl.load(table_ptr + n * stride_tn + pos // BS, mask=visible, other=0).to(tl.int64)
        offs = block_id[:, None] * stride_block + (pos % BS)[:, None] * stride_tok + kvh * stride_head + dims[None, :]
        kv_mask = visible[:, None] & dmask[None, :]
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BN, D]
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BN]
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(visible, scores, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # no key yet: keep every term 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe)
        v = tl.load(cache_ptr + stride_side + offs, mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    part = (n * num_heads + h) * num_splits + s
    tl.store(part_ml_ptr + part * 2, m_i)
    tl.store(part_ml_ptr + part * 2 + 1, l_i)
    tl.store(part_acc_ptr + part * BLOCK_D + dims, acc)


@triton.jit
def _decode_merge_kernel(part_ml_ptr, part_acc_ptr, out_ptr, stride_on, stride_oh, num_splits, num_heads,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    smask = splits < num_splits
    base = (n * num_heads + h) * num_splits
    m = tl.load(part_ml_ptr + (base + splits) * 2, mask=smask, other=NEG_INF)
    l = tl.load(part_ml_ptr + (base + splits) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == NEG_INF, 0.0, tl.exp(m - m_max))
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + n * stride_on + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


# Warps a decode part program runs on. Two, not Triton's default four: a part reads few
# keys (a [64, D] tile or two), and the smaller programs fit more of them on each
# multiprocessor at once. On the H200 (2026-12-04, bf16, 16-token blocks, D = 64, a
# throwaway sweep of tile 32 / 64 / 128, warps 2 / 4 / 8 and split counts): 32 rows x 16
# heads x 192 keys 12.0 -> 8.4 us, 32 rows x 32 heads on 8 x 192 keys 18.0 -> 12.2, 32 x
# 16 x 1,024 keys 54.3 -> 44.4, one row 5.0 -> 4.7; eight warps were the slowest.
DECODE_WARPS = 2

# Programs a decode launch aims for, per streaming multiprocessor: enough to keep every
# one busy, few enough that no wave is mostly empty programs.
PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """The device's SM count (a CPU tensor, in the interpreter: 1)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_splits(rows: int, heads: int, table_width: int, block_size: int, block_n: int, sms: int) -> int:
    """How many parts each (row, head) splits its context into: enough programs for
    ``PROGRAMS_PER_SM`` on each of ``sms`` multiprocessors, at most one a ``block_n``
    tile of the widest row the table can hold. A batch that fills the GPU by itself
    (rows x heads programs) takes one part and reads each row's keys in one program."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, rows * heads)
    return max(1, min(wanted, triton.cdiv(table_width * block_size, block_n)))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, *, window: int | None = None, softcap: float | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """[N, Hq, D] queries, one a row at position ``seq_lens - 1``, over their cached keys
    and values (the row's own included: :func:`store_kv` first) through ``block_table``
    [N, max_blocks]; returns [N, Hq, D] in ``q``'s dtype. Each row's context is split
    into ``num_splits`` parts (by default :func:`decode_splits`' choice, which depends on
    the shapes only, so a captured graph keeps it), a program each, then merged."""
    n, hq, d = q.shape
    _, _, bs, hk, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and q.stride(2) == 1 and hq % hk == 0
    out = torch.empty_like(q)
    if n == 0:
        return out
    block_d = triton.next_power_of_2(d)
    # Keys a tile: 64 keeps a [64, D] float32 tile of keys and one of values within the
    # registers of 4 warps at D = 64 (fewer at wider heads); at least one cache block.
    block_n = max(bs, 64 if block_d <= 64 else 32)
    if num_splits is None:
        num_splits = decode_splits(n, hq, block_table.shape[1], bs, block_n, _multiprocessors(q.device))
    part_ml = torch.empty(n, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(n, hq, num_splits, block_d, dtype=torch.float32, device=q.device)
    _decode_part_kernel[(n, hq, num_splits)](
        q, kv_cache, block_table, seq_lens, part_ml, part_acc, scale, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), num_splits, hq, GROUP=hq // hk, BS=bs, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=DECODE_WARPS)
    _decode_merge_kernel[(n, hq)](part_ml, part_acc, out, out.stride(0), out.stride(1), num_splits, hq, D=d,
                                  BLOCK_D=block_d, SPLITS=triton.next_power_of_2(num_splits))
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, starts_ptr, lens_ptr, ctx_ptr, out_ptr, scale, window, softcap,
                    stride_qt, stride_qh, stride_side, stride_block, stride_tok, stride_head, stride_tc,
                    stride_ot, stride_oh, GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    start = tl.load(starts_ptr + c)
    qlen = tl.load(lens_ptr + c)
    ctx = tl.load(ctx_ptr + c)
    kvh = h // GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < qlen
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [BM, D]
    qpos = ctx + rows
    m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    last = ctx + tl.minimum((mb + 1) * BLOCK_M, qlen)  # keys past the block's last query are never seen
    # BLOCK_N keys an iteration, each through its own block id: a cache block of fewer
    # than 16 tokens is smaller than tl.dot takes (K >= 16), so small blocks are read
    # several to an iteration (BLOCK_N = max(16, BS)).
    for first_key in range(0, last, BLOCK_N):
        kpos = first_key + tl.arange(0, BLOCK_N)
        kmask = kpos < last
        block_id = tl.load(table_ptr + c * stride_tc + kpos // BS, mask=kmask, other=0).to(tl.int64)
        offs = block_id[:, None] * stride_block + (kpos % BS)[:, None] * stride_tok + kvh * stride_head + dims[None, :]
        k = tl.load(cache_ptr + offs, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [BN, D]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BM, BN]
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = (kpos[None, :] <= qpos[:, None]) & rmask[:, None]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        scores = tl.where(visible, scores, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        v = tl.load(cache_ptr + stride_side + offs, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (start + rows)[:, None] * stride_ot + h * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, starts: list[int],
                      lens: list[int], context_lens: list[int], block_table: torch.Tensor, scale: float, *,
                      window: int | None = None, softcap: float | None = None, block_m: int = 16) -> None:
    """Each chunk ``i`` (queries ``starts[i] .. starts[i] + lens[i]`` of ``q`` [T, Hq, D], at
    positions ``context_lens[i]`` on) over keys and values 0 .. its position, read through
    ``block_table[i]`` ([chunks, max_blocks], every block of its context and of the chunk:
    :func:`store_kv` first); writes those rows of ``out`` [T, Hq, D]."""
    if not lens:
        return
    _, hq, d = q.shape
    _, _, bs, hk, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and q.stride(2) == 1 and out.stride(2) == 1 and hq % hk == 0
    dev = q.device
    starts_t = torch.tensor(starts, dtype=torch.int64, device=dev)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    ctx_t = torch.tensor(context_lens, dtype=torch.int64, device=dev)
    grid = (len(lens), hq, triton.cdiv(max(lens), block_m))
    _prefill_kernel[grid](q, kv_cache, block_table, starts_t, lens_t, ctx_t, out, scale, window or 0, softcap or 1.0,
                          q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                          kv_cache.stride(3), block_table.stride(0), out.stride(0), out.stride(1), GROUP=hq // hk,
                          BS=bs, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m,
                          BLOCK_N=max(16, bs), HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None)
