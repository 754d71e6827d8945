"""Builds and calls the C decode-attention kernel (``cpu_decode_attention.c``) on CPU.

In plain torch a decode step must copy each sequence's keys and values out of the
paged cache before SDPA can read them (or keep a dense copy and write every new token
twice); on the 152M model that copying and SDPA's per-head overhead took more time than
all the GEMMs of the step. The C kernel reads the blocks in place.

The kernel is compiled on first use (see :mod:`aserve.kernels.cbuild`) into
``ASERVE_CACHE_DIR/kernels`` (default ``~/.cache/aserve/kernels``). Without a compiler, or with
``ASERVE_CPU_ATTENTION=sdpa``, :func:`load` returns None and the model runner keeps the
plain-torch path (:mod:`aserve.worker.decode_staging`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from aserve.envs import Env, read_env
from aserve.kernels.cbuild import build_ahead, cpu_flags, load_library

_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
_LIMITS = {"group": 64, "head_dim": 512, "block_size": 128}
_DTYPES = (torch.float32, torch.bfloat16)

#: ``attend(q, keys, values, block_table, seq_lens, scale, new_keys=None, new_values=None, prefix_blocks=0,
#: prefix_slot=None)``
DecodeAttention = Callable[..., torch.Tensor]

#: One layer's kept prefix layouts (:class:`PrefixLayouts`): a uint8 buffer and its
#: one-element int32 state.
PrefixSlot = tuple[torch.Tensor, torch.Tensor]

#: The most memory :class:`PrefixLayouts` holds for all layers together. 1,024 prefix
#: tokens of the 152M model (16 KV heads of 64) take 4 MiB a layer, 48 MiB in all; a
#: prefix that needs more is laid out afresh each step, as without the cache.
PREFIX_LAYOUT_MAX_BYTES = 256 << 20


def prefix_supported(cache_dtype: torch.dtype, model_dtype: torch.dtype, flags: frozenset[str] | None = None,
                     env: Env | None = None) -> bool:
    """Whether :func:`load`'s kernel computes a shared prefix for all rows at once here:
    a bf16 cache under a bf16 model, on a CPU with AMX (its tiles) or, without AMX, with
    AVX512-BF16 (``cpu_decode_prefix.h``), not switched off (``ASERVE_CPU_DECODE_PREFIX=0``;
    on an AMX CPU ``ASERVE_CPU_AMX=0`` too, as the library built for it takes the tiles).
    Elsewhere ``prefix_blocks`` changes nothing, and the runner need not find it."""
    env = read_env() if env is None else env
    flags = (cpu_flags() if flags is None else flags) or frozenset()
    amx = {"amx_tile", "amx_bf16"} <= flags
    avx512_bf16 = {"avx512f", "avx512_bf16"} <= flags
    return (env.cpu_decode_prefix and cache_dtype == model_dtype == torch.bfloat16
            and (env.cpu_amx if amx else avx512_bf16))


def prefix_layout_bytes(tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """One layer's prefix layouts (``cpu_decode_prefix.h``'s ``prefix_layout_bytes`` for
    each KV head): K and V, ``tokens`` rounded up to 32 by ``head_dim``, bf16."""
    return num_kv_heads * -(-tokens // 32) * 32 * head_dim * 4


class PrefixLayouts:
    """Decode attention's shared-prefix layouts kept from one step to the next, a
    buffer per layer (the kernel's ``prefix_layout``, ``cpu_decode_prefix.h``).

    Why: the prefix phase lays the prefix's keys and values out for its matrix products
    (K^T in AMX's B layout, values as pairs of keys), and while the same blocks are
    shared those layouts do not change; laying them out again every step cost a third of
    the layer (152M heads, 1,024 prefix tokens, 32 rows: 1.25 against 0.81 ms a layer
    with them kept). Each layer's state is 1 while its buffer holds the layouts of the
    current prefix blocks (the kernel sets it when it lays them out); :meth:`for_step`
    zeroes every state when the prefix's blocks change, and :meth:`written` when a step
    writes any of them: a block is written only once it was freed and handed to another
    request (a shared, full block is never written while in use), so that is how its id
    can come to hold other keys. Memory: at most ``max_bytes``, allocated on first use
    and kept until :meth:`release`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_bytes: int = PREFIX_LAYOUT_MAX_BYTES) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim, self.max_bytes = num_layers, num_kv_heads, head_dim, max_bytes
        self.states = torch.zeros(num_layers, dtype=torch.int32)
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._blocks: np.ndarray | None = None  # the prefix blocks the layouts are (to be) of

    def for_step(self, prefix_block_ids: np.ndarray, block_size: int) -> list[PrefixSlot] | None:
        """Each layer's slot for a step whose decode rows share ``prefix_block_ids``, or
        None when those layouts would take more than ``max_bytes``."""
        per_layer = prefix_layout_bytes(len(prefix_block_ids) * block_size, self.num_kv_heads, self.head_dim)
        if per_layer * self.num_layers > self.max_bytes:
            self._blocks = None
            return None
        if self._blocks is None or not np.array_equal(self._blocks, prefix_block_ids):
            self.states.zero_()
            self._blocks = np.array(prefix_block_ids, dtype=np.int64)
            if self._buffer.numel() < per_layer * self.num_layers:
                self._buffer = torch.empty(per_layer * self.num_layers, dtype=torch.uint8)
        return [(self._buffer[i * per_layer : (i + 1) * per_layer], self.states[i : i + 1])
                for i in range(self.num_layers)]

    def written(self, slots: np.ndarray, block_size: int) -> None:
        """A step writes keys and values into cache ``slots`` (block id x block_size +
        offset): layouts of any of their blocks are stale."""
        if self._blocks is not None and np.isin(self._blocks, slots // block_size).any():
            self._blocks = None

    def release(self) -> None:
        """Forget the layouts and give their memory back (the KV pool went away)."""
        self._blocks = None
        self._buffer = torch.empty(0, dtype=torch.uint8)


def shared_prefix_blocks(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """How many leading columns of ``block_table`` ([B, max_blocks]) hold the same block
    in every row and lie wholly before each row's newest token (position ``seq_len - 1``,
    which this step writes): the shared prefix decode attention may compute once for
    all rows. 0 for fewer than two rows."""
    if block_table.shape[0] < 2:
        return 0
    limit = min(int(seq_lens.min()) - 1, block_table.shape[1] * block_size) // block_size
    same = (block_table[:, :limit] == block_table[0, :limit]).all(axis=0)
    return int(limit if same.all() else same.argmin())


def build() -> None:
    """Compile the library :func:`load` loads, unless it is switched off (a worker runs
    this on a thread while it loads the model; ``cbuild.build_ahead``)."""
    env = read_env()
    if env.cpu_attention != "sdpa":
        build_ahead(_SOURCE, env.cache_dir / "kernels")


def load(extra_flags: tuple[str, ...] = ()) -> DecodeAttention | None:
    """The kernel as ``attend(q, keys, values, block_table, seq_lens, scale, new_keys=None,
    new_values=None, prefix_blocks=0, prefix_slot=None) -> out``, or None where it is
    unavailable or switched off (``ASERVE_CPU_ATTENTION=sdpa``).

    ``q``: [B, Hq, D] (rows and heads may be strided, the last dim contiguous);
    ``keys`` / ``values``: one layer's paged cache halves, [num_blocks, block_size, Hk, D],
    read through their strides (the same for both; each row of D contiguous): token-major,
    or the CPU pool's head-major blocks (:func:`aserve.kernels.attention.head_major`);
    ``block_table``: int64 [B, max_blocks]; ``seq_lens``: int64 [B], the keys each row
    attends to, its own new token included: either already in the cache, or given as
    ``new_keys`` / ``new_values`` ([B, Hk, D]), which the kernel writes into the slot of
    position ``seq_len - 1`` first, rounded to the cache's dtype. Returns [B, Hq, D] in
    q's dtype. q (with the new keys and values) and the cache are each float32 or
    bfloat16, not necessarily the same: a bf16 cache under a float32 model is
    ``--kv-cache-dtype bfloat16``. ``prefix_blocks``: the leading columns of
    ``block_table`` that every row shares, each row's context reaching past them
    (:func:`shared_prefix_blocks`); on a CPU with AMX or AVX512-BF16, with bf16 queries
    and cache, the kernel attends over them for all rows at once as matrix products
    (``cpu_decode_prefix.h``), where it pays; elsewhere it changes nothing.
    ``prefix_slot``: where that phase keeps its layouts of the prefix between calls (a
    :class:`PrefixLayouts` slot: the buffer, at least :func:`prefix_layout_bytes` long, and its
    state, which the kernel sets to 1 once the buffer holds these blocks' layouts and
    then trusts; the caller zeroes it when the blocks change), or None.
    ``extra_flags``: more compiler flags (tests build the AVX512-BF16 form on an AMX CPU
    with ``-mno-amx-tile``).
    """
    env = read_env()
    if env.cpu_attention == "sdpa":
        return None
    lib = load_library(_SOURCE, env.cache_dir / "kernels", "decode attention", extra_flags)
    if lib is None:
        return None
    fn = lib.aserve_decode_attention
    i64 = ctypes.c_int64
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr] * 5 + [i64] * 4 + [ptr] * 3 + [i64] * 7 + [ptr] * 2 + [i64] * 7 + [ctypes.c_float] + [ctypes.c_int] * 3
    fn.restype = ctypes.c_int

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, new_keys: torch.Tensor | None = None,
               new_values: torch.Tensor | None = None, prefix_blocks: int = 0,
               prefix_slot: PrefixSlot | None = None) -> torch.Tensor:
        if q.dtype not in _DTYPES or keys.dtype not in _DTYPES or values.dtype != keys.dtype:
            raise TypeError(f"decode attention takes float32 or bfloat16 queries and caches, not {q.dtype} / "
                            f"{keys.dtype} / {values.dtype}")
        if keys.stride() != values.stride() or keys.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("decode attention needs [blocks, block_size, Hk, D] caches of one layout, rows contiguous")
        if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise TypeError("block_table and seq_lens must be int64")
        if (new_keys is None) != (new_values is None):
            raise ValueError("pass both new_keys and new_values, or neither")
        if new_keys is not None and new_values is not None:
            shape = (q.shape[0], keys.shape[2], keys.shape[3])
            for t in (new_keys, new_values):
                if t.shape != shape or t.dtype != q.dtype or t.stride(-1) != 1:
                    raise ValueError("new_keys / new_values must be [B, Hk, D] in q's dtype, last dim contiguous")
            new_k, new_v = new_keys.data_ptr(), new_values.data_ptr()
            new_strides = (*new_keys.stride()[:2], *new_values.stride()[:2])
        else:
            new_k, new_v, new_strides = None, None, (0, 0, 0, 0)
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        batch, hq, dim = q.shape
        _, block_size, hk, _ = keys.shape
        if prefix_slot is not None:
            layout, state = prefix_slot
            need = prefix_layout_bytes(prefix_blocks * block_size, hk, dim)
            if (layout.dtype != torch.uint8 or not layout.is_contiguous() or layout.numel() < need
                    or state.dtype != torch.int32 or state.numel() != 1):
                raise ValueError(f"prefix_slot must be a contiguous uint8 buffer of at least {need} bytes and a "
                                 "one-element int32 state")
        out = torch.empty(batch, hq, dim, dtype=q.dtype)
        rc = fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), new_k, new_v, *new_strides, out.data_ptr(),
                block_table.data_ptr(), seq_lens.data_ptr(),
                batch, hq, hk, dim, block_size, block_table.shape[1], prefix_blocks,
                prefix_slot[0].data_ptr() if prefix_slot is not None else None,
                prefix_slot[1].data_ptr() if prefix_slot is not None else None,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                keys.stride(0), keys.stride(1), keys.stride(2),
                scale, int(q.dtype == torch.bfloat16), int(keys.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"decode attention supports at most {_LIMITS} (got {hq // hk} query heads per KV head, "
                             f"head_dim {dim}, block size {block_size})")
        return out

    return attend
