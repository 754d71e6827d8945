"""KV cache sizing from the architecture alone, before any weight is loaded (torch-free:
the engine core sizes the pool, see ``aserve.model.dtypes``)."""

from __future__ import annotations

from aserve.model.dtypes import ITEMSIZE
from aserve.model.hf_config import ArchConfig


def local_kv_heads(arch: ArchConfig, tp_size: int) -> int:
    """KV heads on one rank (replicated when there are more ranks than heads)."""
    return max(1, arch.num_key_value_heads // tp_size)


def bytes_per_block(arch: ArchConfig, *, tp_size: int, dtype: str, block_size: int, num_layers: int | None = None) -> int:
    """Bytes one KV block takes on one rank, over its layers (keys and values): all of
    them, or ``num_layers`` (a pipeline stage's); ``dtype`` is a resolved name
    (``aserve.model.dtypes.resolve_dtype_name``)."""
    layers = arch.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * block_size * local_kv_heads(arch, tp_size) * arch.head_dim * ITEMSIZE[dtype]
