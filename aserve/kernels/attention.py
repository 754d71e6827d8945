"""Paged attention in plain torch: the CPU path, and the reference for the Triton kernels.

Everything the model needs from the KV cache goes through :func:`paged_attention`; with
``meta.triton`` it runs the Triton kernels of :mod:`aserve.kernels.triton_attention` (the
GPU path, and the interpreter in tests), whose twin is this module's torch. Decode rows use the C
kernel of :mod:`aserve.kernels.cpu_decode_attention` when the runner could build it, and
prefill chunks that of :mod:`aserve.kernels.cpu_prefill_attention` (bf16 on AMX or AVX512-BF16, float32 on
AVX-512F or AVX2 + FMA, over a cache of the model's dtype), else SDPA.

KV cache of one layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)
    slot = block_id * block_size + offset_in_block

The cache may store a narrower dtype than the model computes in (``--kv-cache-dtype``):
keys and values are rounded to it as they are written, and every path attends over
the values as stored, in the model's dtype, the current chunk's own keys included, so
the C kernels and SDPA compute the same thing.

Reads gather whole blocks (``index_select`` of contiguous rows, the fastest gather on a
CPU) and mask the keys past each sequence's end. The cache starts as zeros and only
ever holds finite values, so a masked position multiplies a finite value by zero.
Block 0 is never handed to a request; padded block-table entries point at it.

A step's tokens are laid out decode requests first (one token each), then prefill
chunks (one or more tokens each, possibly after cached context).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from aserve.kernels.cpu_decode_attention import DecodeAttention, PrefixSlot
from aserve.kernels.cpu_prefill_attention import PrefillAttention
from aserve.kernels.cpu_prefill_attention import supports as prefill_kernel_supports


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first token of the chunk in the step's flattened batch
    end: int
    context_len: int  # tokens of this request already in the cache before the chunk
    block_ids: torch.Tensor | None  # [ceil((context_len + chunk) / block_size)]; None when context_len == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V are written
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None  # [num_decode, max_blocks], padded with block 0
    # [num_decode, 1, 1, L]: 0 where a key counts, -inf where it does not (additive, in
    # the model dtype: SDPA would convert a boolean mask again in every layer). None when
    # every decode row attends to all L keys (always so for a single request).
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]
    # Flat scratch buffers for gathered keys and values, large enough for any gather
    # of this step. Reused by every layer: a fresh multi-megabyte tensor per gather
    # would cost a page fault per 4 KiB, which on a CPU is slower than the copy itself.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # Dense staging (aserve.worker.decode_staging), when the runner keeps it: the row of
    # each decode token's request, where its keys go in ``staged.view(-1, D)`` ([N * Hk]),
    # and whether the rows are 0 .. n-1 in order (then attention reads a view).
    decode_rows: torch.Tensor | None = None
    decode_write_index: torch.Tensor | None = None
    decode_rows_packed: bool = False
    decode_len: int = 0  # L: keys each decode row's attention reads (some masked)
    # The C kernel (aserve.kernels.cpu_decode_attention), when the runner has it: decode
    # rows then attend in place over the paged cache, through ``decode_block_table`` and
    # these lengths ([num_decode] int64, the new token included).
    decode_kernel: DecodeAttention | None = None
    decode_seq_lens: torch.Tensor | None = None
    # Leading columns of ``decode_block_table`` every decode row shares, each row's
    # context past them: the kernel attends over them for all rows at once (AMX or
    # AVX512-BF16, bf16). 0
    # where the runner does not look (aserve.kernels.cpu_decode_attention.prefix_supported).
    decode_prefix_blocks: int = 0
    # The C kernel (aserve.kernels.cpu_prefill_attention), when the runner has it: every
    # prefill chunk of the step in one call, a chunk after cached context reading its
    # keys and values from the paged cache.
    prefill_kernel: PrefillAttention | None = None
    # The C write of keys and values into the paged cache (FusedOps.write_kv), when the
    # runner has it; else write_kv below.
    kv_writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    # The Triton kernels (aserve.kernels.triton_attention) do all of it: the store, decode
    # rows from ``decode_block_table``, and every chunk through its ``block_ids`` (which
    # the runner then sets for every chunk, cached context or not).
    triton: bool = False
    # Called after each layer of a step run layer by layer (not inside the one-call
    # decode step): a worker process's progress counter, which tells the engine core
    # that a long step is slow, not stuck (aserve.process.heartbeat.Progress).
    layer_done: Callable[[], None] | None = None

    def store_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``k`` and ``v`` into their slots: by ``kv_writer`` where the runner has one,
        else :func:`write_kv`."""
        (self.kv_writer or write_kv)(kv_cache, k, v, slot_mapping)

    @cached_property
    def prefill_spans(self) -> tuple[list[int], list[int], list[int] | None, torch.Tensor | None]:
        """The prefill chunks as the prefill kernel takes them, built once a step (every
        layer reads them): starts, lengths, and when any chunk follows cached context,
        the context lengths and a block table padded with block 0 ([chunks, max_blocks])."""
        chunks = self.prefills
        starts, lens = [c.start for c in chunks], [c.end - c.start for c in chunks]
        with_blocks = [c.block_ids for c in chunks if c.block_ids is not None]
        if not with_blocks:
            return starts, lens, None, None
        table = torch.zeros(len(chunks), max(ids.numel() for ids in with_blocks), dtype=torch.int64)
        for row, c in enumerate(chunks):
            if c.block_ids is not None:
                table[row, : c.block_ids.numel()] = c.block_ids
        return starts, lens, [c.context_len for c in chunks], table


@dataclass
class LayerKV:
    """One layer's KV cache: the paged tensor and, optionally, dense decode staging."""

    paged: torch.Tensor  # [2, num_blocks, block_size, Hk, D] (strides: see head_major)
    staged_keys: torch.Tensor | None = None  # [rows, Hk, max_len, D]
    staged_values: torch.Tensor | None = None
    # This step's slot for the C kernel's kept prefix layouts (PrefixLayouts), set by
    # the runner for a step whose decode rows share a prefix; else None.
    prefix_slot: PrefixSlot | None = None


def head_major(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The CPU KV pool: ``flat`` (its memory) viewed as ``shape``, ``[..., blocks,
    block_size, Hk, D]``, with each block stored head by head (``[..., blocks, Hk,
    block_size, D]`` in memory). Every reader indexes it by the same logical shape and
    its strides; the decode kernel reads a KV head's rows of a block in a row, which the
    memory system streams, where a token-major block puts them 2 KiB apart (152M shape,
    bf16) (docs/engine.md, "The KV cache's layout")."""
    *lead, bs, hk, d = shape
    return flat.view(*lead, hk, bs, d).transpose(-3, -2)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Keys and values ([T, Hk, D]) into slots ``slot_mapping`` (block * block_size +
    offset) of ``kv_cache`` ([2, blocks, block_size, Hk, D], any strides)."""
    if kv_cache.is_contiguous():
        kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    # Another layout (the CPU pool's head-major one): by (block, offset). The runner
    # writes that pool with FusedOps.write_kv instead, where the C kernels load.
    bs = kv_cache.shape[2]
    where = (slot_mapping // bs, slot_mapping % bs)
    kv_cache[0].index_put_(where, k.to(kv_cache.dtype))
    kv_cache[1].index_put_(where, v.to(kv_cache.dtype))


def as_stored(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``t`` (keys or values) as a cache of ``cache_dtype`` holds them, in ``t``'s dtype."""
    return t if t.dtype == cache_dtype else t.to(cache_dtype).to(t.dtype)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, Hk, D] keys or values,
    written into ``buffer`` (flat, large enough) when given."""
    ids = block_ids.reshape(-1)
    if buffer is None:
        rows = cache.index_select(0, ids)
    else:
        rows = buffer[: ids.numel() * cache[0].numel()].view(ids.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, ids, out=rows)
    return rows.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def gather_numel(num_blocks: int, kv_cache: torch.Tensor) -> int:
    """Elements a gather of ``num_blocks`` blocks of one layer's keys (or values) takes."""
    return num_blocks * kv_cache[0, 0].numel()


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    layer_kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, Hq, D].

    ``window``: a sliding-window layer's width (a query at position p sees the keys at
    p - window + 1 .. p, as Hugging Face's masks say); ``softcap``: the attention logits
    become ``softcap * tanh(logits / softcap)`` before the softmax (Gemma 2). Either
    takes the masked path (:func:`masked_attention`), which the C kernels do not cover."""
    if meta.triton:
        return _triton_attention(q, k, v, layer_kv.paged, meta, scale, window, softcap)
    if window is not None or softcap is not None:
        return masked_attention(q, k, v, layer_kv, meta, scale, window, softcap)
    kv_cache = layer_kv.paged
    nd = meta.num_decode_tokens
    if nd and meta.decode_kernel is not None:
        # The kernel writes the decode tokens' keys and values itself.
        if nd < k.shape[0]:
            meta.store_kv(kv_cache, k[nd:], v[nd:], meta.slot_mapping[nd:])
    else:
        meta.store_kv(kv_cache, k, v, meta.slot_mapping)
    gqa = q.shape[1] != k.shape[1]
    kbuf, vbuf = meta.gather_buffers or (None, None)
    # A step of decodes only (the common case) returns the decode output itself.
    out = None if not meta.prefills else torch.empty_like(q)
    if nd:
        o = _decode_attention(q[:nd], k[:nd], v[:nd], layer_kv, meta, scale, gqa)
        if out is None:
            return o
        out[:nd] = o
    assert out is not None
    if meta.prefill_kernel is not None and prefill_kernel_supports(q, k):
        starts, lens, context_lens, table = meta.prefill_spans
        context = None if table is None else (context_lens, table, kv_cache[0], kv_cache[1])
        meta.prefill_kernel(q, k, v, out, starts, lens, scale, context)
        return out
    # Prefill tensors are 4-D ([1, H, S, D]): the CPU flash kernel takes only those,
    # and 3-D inputs fall back to the much slower math path.
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
        if chunk.block_ids is None:
            kc = as_stored(k[chunk.start : chunk.end], kv_cache.dtype).transpose(0, 1).unsqueeze(0)
            vc = as_stored(v[chunk.start : chunk.end], kv_cache.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # [1, Hk, blocks * block_size, D]
            kc = gather_blocks(kv_cache[0], chunk.block_ids, kbuf).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vc = gather_blocks(kv_cache[1], chunk.block_ids, vbuf).transpose(0, 1).unsqueeze(0).to(q.dtype)
            n_q = chunk.end - chunk.start
            # Query i (at position context_len + i) sees keys 0 .. context_len + i.
            mask = (torch.arange(kc.shape[2], device=q.device)
                    <= (chunk.context_len + torch.arange(n_q, device=q.device)).unsqueeze(1))
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """:func:`paged_attention` on the Triton kernels: the store, then the decode rows and
    the prefill chunks, each straight from the paged cache (windows and soft-capping
    included)."""
    from aserve.kernels import triton_attention as tk  # imports triton: only where it is chosen

    tk.store_kv(kv_cache, k, v, meta.slot_mapping)
    nd = meta.num_decode_tokens
    out = torch.empty_like(q)
    if nd:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        out[:nd] = tk.decode_attention(q[:nd], kv_cache, meta.decode_block_table, meta.decode_seq_lens, scale,
                                       window=window, softcap=softcap)
    if meta.prefills:
        starts, lens, context_lens, table = meta.prefill_spans
        assert table is not None and context_lens is not None, "the Triton path needs every chunk's block_ids"
        tk.prefill_attention(q, kv_cache, out, starts, lens, context_lens, table.to(q.device), scale, window=window,
                             softcap=softcap)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV, meta: AttentionMetadata,
                      scale: float, gqa: bool) -> torch.Tensor:
    """The decode rows' attention ([Nd, Hq, D]) by whichever path the runner set up: the C
    kernel (it writes k and v itself), dense staging, or SDPA over gathered blocks."""
    kv_cache = layer_kv.paged
    if meta.decode_kernel is not None:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        return meta.decode_kernel(q, kv_cache[0], kv_cache[1], meta.decode_block_table, meta.decode_seq_lens, scale,
                                  k, v, prefix_blocks=meta.decode_prefix_blocks, prefix_slot=layer_kv.prefix_slot)
    if meta.decode_rows is not None:
        assert layer_kv.staged_keys is not None and layer_kv.staged_values is not None
        staged_k, staged_v = layer_kv.staged_keys, layer_kv.staged_values
        d = k.shape[-1]
        k, v = as_stored(k, kv_cache.dtype), as_stored(v, kv_cache.dtype)
        staged_k.view(-1, d).index_copy_(0, meta.decode_write_index, k.reshape(-1, d))
        staged_v.view(-1, d).index_copy_(0, meta.decode_write_index, v.reshape(-1, d))
        length = meta.decode_len
        if meta.decode_rows_packed:
            nd = q.shape[0]
            keys, values = staged_k[:nd, :, :length], staged_v[:nd, :, :length]  # views: [B, Hk, L, D]
        else:
            keys = staged_k.index_select(0, meta.decode_rows)[:, :, :length]
            values = staged_v.index_select(0, meta.decode_rows)[:, :, :length]
    else:
        assert meta.decode_block_table is not None
        kbuf, vbuf = meta.gather_buffers or (None, None)
        keys = gather_blocks(kv_cache[0], meta.decode_block_table, kbuf).transpose(1, 2).to(q.dtype)  # [B, Hk, L, D]
        values = gather_blocks(kv_cache[1], meta.decode_block_table, vbuf).transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
    ).squeeze(2)  # [B, Hq, D]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV, meta: AttentionMetadata,
                     scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention with a sliding window and/or logit soft-capping, in torch, over the
    paged cache: the path of the layers the C kernels do not cover. A decode row reads
    only the blocks that hold its window; the masks are built from positions, so a chunk
    after cached context (a prefix hit, or a later chunk) sees exactly the keys a full
    forward pass would."""
    kv_cache = layer_kv.paged
    meta.store_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        table = meta.decode_block_table
        seq_lens = meta.decode_seq_lens.to(table.device)
        dev = table.device
        bs = kv_cache.shape[2]
        first_pos = torch.zeros_like(seq_lens) if window is None else (seq_lens - window).clamp(min=0)
        first_block = first_pos // bs
        span = int(((seq_lens - 1) // bs - first_block).max()) + 1  # blocks each row reads
        cols = (first_block.unsqueeze(1) + torch.arange(span, device=dev)).clamp(max=table.shape[1] - 1)
        blocks = table.gather(1, cols)  # [Nd, span]
        keys = gather_blocks(kv_cache[0], blocks).to(q.dtype)  # [Nd, span * bs, Hk, D]
        values = gather_blocks(kv_cache[1], blocks).to(q.dtype)
        pos = first_block.unsqueeze(1) * bs + torch.arange(span * bs, device=dev)  # [Nd, S] each key's position
        visible = (pos < seq_lens.unsqueeze(1)) & (pos >= first_pos.unsqueeze(1))
        out[:nd] = _attend(q[:nd].unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                           visible[:, None, None, :], scale, softcap).squeeze(2)
    for chunk in meta.prefills:
        n_q = chunk.end - chunk.start
        if chunk.block_ids is None:
            keys = as_stored(k[chunk.start : chunk.end], kv_cache.dtype)
            values = as_stored(v[chunk.start : chunk.end], kv_cache.dtype)
        else:
            keys = gather_blocks(kv_cache[0], chunk.block_ids).to(q.dtype)
            values = gather_blocks(kv_cache[1], chunk.block_ids).to(q.dtype)
        q_pos = chunk.context_len + torch.arange(n_q, device=q.device).unsqueeze(1)  # [S, 1]
        k_pos = torch.arange(keys.shape[0], device=q.device).unsqueeze(0)  # [1, Sk]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
        o = _attend(qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), visible, scale,
                    softcap)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """[B, Hq, S, D] queries over [B, Hk, Sk, D] keys and values where ``visible``
    (broadcast to [B, Hq, S, Sk]) allows. With ``softcap``, the eager form Hugging Face's
    Gemma 2 computes: scores in the model's dtype, capped, softmax in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)
