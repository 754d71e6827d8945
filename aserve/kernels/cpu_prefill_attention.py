"""Builds and calls the C prefill-attention kernel (``cpu_prefill_attention.c``): causal
attention of a step's prefill chunks, bf16, on AMX tiles, or, on a CPU with AVX512-BF16
and no AMX, its ``vdpbf16ps`` form (``cpu_prefill_attention_avx512.c``, the same
contract).

torch's CPU flash kernel, called once per prompt, ran a 7M model's prefill attention at
~110 GFLOP/s; the C kernel does both products on AMX and takes every prefill chunk of a
step in one call. A chunk after cached context (a prefix hit, or a later chunk of a long
prompt) reads its keys and values from the paged cache, where SDPA needed them gathered
into a copy first.

Built on first use like the other kernels (:mod:`aserve.kernels.cbuild`). :func:`load`
returns None without AMX or AVX512-BF16 (or with both switched off: ``ASERVE_CPU_AMX=0``,
``ASERVE_CPU_BF16_LINEAR=0``), without a compiler, or with ``ASERVE_CPU_ATTENTION=sdpa``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.amx_linear import load_amx_library
from aserve.kernels.bf16_linear import load_library_checked as load_bf16_library

_SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
_AVX512_SOURCE = Path(__file__).with_name("cpu_prefill_attention_avx512.c")
MAX_HEAD_DIM = 256

#: ``attend(q, k, v, out, starts, lens, scale, context=None)``: see :func:`load`.
PrefillAttention = Callable[..., None]


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes queries and keys of these shapes and dtype."""
    d = q.shape[-1]
    return (q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and d % 32 == 0 and d <= MAX_HEAD_DIM
            and q.shape[1] % k.shape[1] == 0)


def load() -> PrefillAttention | None:
    """The kernel as ``attend(q, k, v, out, starts, lens, scale, context=None)``, or None
    where it is unavailable or switched off.

    ``q``, ``out``: [T, Hq, D]; ``k``, ``v``: [T, Hk, D], all bf16 with heads and D
    contiguous (tokens may be strided), Hq a multiple of Hk and D of 32 (see
    :func:`supports`). Chunk ``i`` is tokens ``starts[i] .. starts[i] + lens[i] - 1``;
    its rows of ``out`` are written, other rows are left alone. Without ``context`` each
    chunk is a whole prompt: its tokens attend causally to each other. ``context`` is
    ``(ctx_lens, block_table, k_cache, v_cache)``: chunk ``i`` then follows
    ``ctx_lens[i]`` cached tokens, and when that is over 0 its keys and values, the
    cached ones and its own (already written there), are read from the paged cache
    halves ([blocks, block_size, Hk, D]) through row ``i`` of ``block_table`` (int64
    [n, max_blocks]).
    """
    env = read_env()
    if env.cpu_attention == "sdpa":
        return None
    lib = load_amx_library(_SOURCE, env.cache_dir / "kernels", "prefill attention (AMX)") if env.cpu_amx else None
    if lib is None and env.cpu_bf16_linear:
        lib = load_bf16_library(_AVX512_SOURCE, "prefill attention (AVX512-BF16)", "aserve_prefill_attention_available")
    if lib is None:
        return None
    fn = lib.aserve_prefill_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64,
                   i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: Sequence[int],
               lens: Sequence[int], scale: float,
               context: tuple[Sequence[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        if not supports(q, k) or v.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            raise ValueError(f"prefill attention takes bf16 with head_dim a multiple of 32 up to {MAX_HEAD_DIM}, "
                             f"query heads a multiple of KV heads (got {q.dtype}, {tuple(q.shape)}, {tuple(k.shape)})")
        for t in (q, k, v, out):
            if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError("prefill attention needs each token's heads contiguous")
        if v.shape != k.shape or q.shape[0] != k.shape[0] or out.shape != q.shape:
            raise ValueError("q and out must be [T, Hq, D], k and v [T, Hk, D]")
        n = len(starts)
        if len(lens) != n:
            raise ValueError("starts and lens differ in length")
        total = q.shape[0]
        if any(s < 0 or n_ < 0 or s + n_ > total for s, n_ in zip(starts, lens)):
            raise ValueError("a prompt runs past the batch")
        c_starts = (ctypes.c_int64 * max(n, 1))(*starts)
        c_lens = (ctypes.c_int64 * max(n, 1))(*lens)
        c_ctx = table_ptr = k_cache_ptr = v_cache_ptr = None
        max_blocks = block_size = stride_block = stride_token = 0
        if context is not None:
            ctx_lens, table, k_cache, v_cache = context
            if len(ctx_lens) != n or table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != n:
                raise ValueError("context needs a length and an int64 block-table row per chunk")
            if (k_cache.dtype != torch.bfloat16 or k_cache.stride() != v_cache.stride()
                    or k_cache.shape[2:] != k.shape[1:] or k_cache.stride(-1) != 1 or k_cache.stride(-2) != k.shape[-1]):
                raise ValueError("the cache halves must be bf16 [blocks, block_size, Hk, D] with contiguous heads")
            table = table.contiguous()
            block_size = k_cache.shape[1]
            if any(c < 0 or (c > 0 and -(-(c + n_) // block_size) > table.shape[1]) for c, n_ in zip(ctx_lens, lens)):
                raise ValueError("a chunk runs past its block-table row")
            c_ctx = (ctypes.c_int64 * max(n, 1))(*ctx_lens)
            table_ptr, k_cache_ptr, v_cache_ptr = table.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
            max_blocks, stride_block, stride_token = table.shape[1], k_cache.stride(0), k_cache.stride(1)
        _, hq, d = q.shape
        rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                out.stride(0), c_starts, c_lens, c_ctx, n, k_cache_ptr, v_cache_ptr, table_ptr, max_blocks, block_size,
                stride_block, stride_token, hq, k.shape[1], d, scale, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("prefill attention could not allocate its scratch memory")

    return attend
