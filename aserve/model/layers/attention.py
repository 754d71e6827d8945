"""The attention layer: rotary, then paged attention over this layer's KV cache."""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels.attention import AttentionMetadata, LayerKV, paged_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 window: int | None = None, softcap: float | None = None) -> None:
        """``window``: a sliding-window layer's width; ``softcap``: the attention logits'
        soft cap (see :func:`~aserve.kernels.attention.paged_attention`)."""
        super().__init__()
        self.window = window
        self.softcap = softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)  # [T, Hq, D]
