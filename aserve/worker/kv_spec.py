"""KV cache sizing from the architecture alone, before any weight is loaded."""

from __future__ import annotations

import torch

from aserve.model.hf_config import ArchConfig


def local_kv_heads(arch: ArchConfig, tp_size: int) -> int:
    """KV heads on one rank (replicated when there are more ranks than heads)."""
    return max(1, arch.num_key_value_heads // tp_size)


def bytes_per_block(arch: ArchConfig, *, tp_size: int, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block takes on one rank, over all layers (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * local_kv_heads(arch, tp_size) * arch.head_dim * itemsize
