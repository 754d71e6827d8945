"""The paged KV cache in either layout the kernels take, for their tests."""

from __future__ import annotations

import torch

from aserve.kernels.attention import head_major

LAYOUTS = ("token", "head")


def in_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """``cache`` ([..., blocks, block_size, Hk, D]) as is ("token": each block token by
    token), or a copy in the CPU pool's layout ("head": each block KV head by KV head,
    :func:`aserve.kernels.attention.head_major`); the same values either way."""
    if layout == "token":
        return cache
    out = head_major(torch.empty(cache.numel(), dtype=cache.dtype), tuple(cache.shape))
    assert out.stride(-2) == cache.shape[-3] * cache.shape[-1]  # one head's rows of a block in a row
    return out.copy_(cache)
