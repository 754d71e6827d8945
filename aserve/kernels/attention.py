"""Paged attention in plain torch: the CPU path, and the reference for device kernels.

Everything the model needs from the KV cache goes through :func:`paged_attention`, so a
CUDA build can swap in its own kernel behind the same signature.

KV cache of one layer::

    kv_cache: [2, num_slots, num_kv_heads, head_dim]     (0 = keys, 1 = values)
    slot = block_id * block_size + offset_in_block

Block 0 is never handed to a request: it stays zero, and padded gather indices point at
it, so padding never reads uninitialised memory.

A step's tokens are laid out decode requests first (one token each), then prefill
chunks (one or more tokens each, possibly after cached context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first token of the chunk in the step's flattened batch
    end: int
    context_len: int  # tokens of this request already in the cache before the chunk
    slots: torch.Tensor | None  # [context_len + chunk] cache slots; None when context_len == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V are written
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [num_decode, max_len] cache slots, padded with 0
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len] True where a key counts
    prefills: tuple[PrefillChunk, ...]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, Hq, D]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_slots is not None
        keys = kv_cache[0][meta.decode_slots].transpose(1, 2)  # [B, Hk, L, D]
        values = kv_cache[1][meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )  # [B, Hq, 1, D]
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1)  # [Hq, S, D]
        if chunk.slots is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1)
            vc = v[chunk.start : chunk.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kc = kv_cache[0][chunk.slots].transpose(0, 1)  # [Hk, C + S, D]
            vc = kv_cache[1][chunk.slots].transpose(0, 1)
            n_q = chunk.end - chunk.start
            total = chunk.context_len + n_q
            # Query i (at position context_len + i) sees keys 0 .. context_len + i.
            mask = torch.arange(total) <= (chunk.context_len + torch.arange(n_q)).unsqueeze(1)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[chunk.start : chunk.end] = o.transpose(0, 1)
    return out
