"""Builds and calls the C prefill-attention kernels: causal attention of a step's prefill
chunks. bf16 runs on AMX tiles (``cpu_prefill_attention.c``), or, on a CPU with
AVX512-BF16 and no AMX, in its ``vdpbf16ps`` form (``cpu_prefill_attention_avx512.c``,
the same contract); float32 in AVX-512F or AVX2 + FMA (``cpu_prefill_attention_f32.c``,
the same contract in floats).

torch's CPU flash kernel, called once per prompt, ran a 7M model's prefill attention at
~110 GFLOP/s; the C kernel does both products on AMX and takes every prefill chunk of a
step in one call. A chunk after cached context (a prefix hit, or a later chunk of a long
prompt) reads its keys and values from the paged cache, where SDPA needed them gathered
into a copy first.

In float32 the flash kernel ran a 7M model's 2,048-token prompt at ~61 GFLOP/s on one
Zen 4 core (35.5 ms a layer, about 65% of that prompt's prefill); the float32 kernel, a
register block of float32 FMAs over a K^T layout with float32 weights between the
products, takes 13-15 ms.

Built on first use like the other kernels (:mod:`aserve.kernels.cbuild`). :func:`load`
returns None without a compiler, with ``ASERVE_CPU_ATTENTION=sdpa``, and: for bf16
without AMX or AVX512-BF16 (or with both switched off: ``ASERVE_CPU_AMX=0``,
``ASERVE_CPU_BF16_LINEAR=0``); for float32 without AVX2 and FMA.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.amx_linear import load_amx_library
from aserve.kernels.bf16_linear import load_library_checked as load_bf16_library
from aserve.kernels.cbuild import load_library
from aserve.kernels.f32_linear import cpu_supported as f32_cpu_supported

_SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
_AVX512_SOURCE = Path(__file__).with_name("cpu_prefill_attention_avx512.c")
_F32_SOURCE = Path(__file__).with_name("cpu_prefill_attention_f32.c")
MAX_HEAD_DIM = 256
#: What head_dim must be a multiple of, by dtype.
_D_MULTIPLE = {torch.bfloat16: 32, torch.float32: 16}

#: ``attend(q, k, v, out, starts, lens, scale, context=None)``: see :func:`load`.
PrefillAttention = Callable[..., None]


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel of q's dtype takes queries and keys of these shapes and dtype
    (the runner loads the kernel of its model's dtype)."""
    d = q.shape[-1]
    multiple = _D_MULTIPLE.get(q.dtype)
    return (multiple is not None and k.dtype == q.dtype and d % multiple == 0 and d <= MAX_HEAD_DIM
            and q.shape[1] % k.shape[1] == 0)


def _load_library(dtype: torch.dtype, extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library of ``dtype``'s kernel, or None where it is unavailable or switched off."""
    env = read_env()
    if env.cpu_attention == "sdpa":
        return None
    if dtype == torch.float32:
        if not f32_cpu_supported():
            return None
        return load_library(_F32_SOURCE, env.cache_dir / "kernels", "prefill attention (float32)", extra_flags,
                            available="aserve_prefill_attention_f32_available")
    lib = load_amx_library(_SOURCE, env.cache_dir / "kernels", "prefill attention (AMX)") if env.cpu_amx else None
    if lib is None and env.cpu_bf16_linear:
        lib = load_bf16_library(_AVX512_SOURCE, "prefill attention (AVX512-BF16)", "aserve_prefill_attention_available")
    return lib


def load(dtype: torch.dtype = torch.bfloat16, extra_flags: tuple[str, ...] = ()) -> PrefillAttention | None:
    """The kernel of ``dtype`` (bfloat16 or float32) as ``attend(q, k, v, out, starts,
    lens, scale, context=None)``, or None where it is unavailable or switched off.
    ``extra_flags``: for the float32 kernel's compiler (tests build its AVX2 form on an
    AVX-512 CPU with ``-mno-avx512f``).

    ``q``, ``out``: [T, Hq, D]; ``k``, ``v``: [T, Hk, D], all of ``dtype`` with heads and
    D contiguous (tokens may be strided), Hq a multiple of Hk and D of 32 for bf16, of 16
    for float32 (see :func:`supports`). Chunk ``i`` is tokens ``starts[i] .. starts[i] + lens[i] - 1``;
    its rows of ``out`` are written, other rows are left alone. Without ``context`` each
    chunk is a whole prompt: its tokens attend causally to each other. ``context`` is
    ``(ctx_lens, block_table, k_cache, v_cache)``: chunk ``i`` then follows
    ``ctx_lens[i]`` cached tokens, and when that is over 0 its keys and values, the
    cached ones and its own (already written there), are read from the paged cache
    halves ([blocks, block_size, Hk, D], of ``dtype``, read through their strides: either
    block layout, rows of D contiguous) through row ``i`` of ``block_table`` (int64 [n,
    max_blocks]).
    """
    if dtype not in _D_MULTIPLE:
        raise ValueError(f"no prefill attention kernel for {dtype}")
    lib = _load_library(dtype, extra_flags)
    if lib is None:
        return None
    fn = lib.aserve_prefill_attention_f32 if dtype == torch.float32 else lib.aserve_prefill_attention
    name = "float32" if dtype == torch.float32 else "bf16"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64,
                   i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: Sequence[int],
               lens: Sequence[int], scale: float,
               context: tuple[Sequence[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        if q.dtype != dtype or not supports(q, k) or v.dtype != dtype or out.dtype != dtype:
            raise ValueError(f"prefill attention ({name}) takes {name} with head_dim a multiple of "
                             f"{_D_MULTIPLE[dtype]} up to {MAX_HEAD_DIM}, query heads a multiple of KV heads "
                             f"(got {q.dtype}, {tuple(q.shape)}, {tuple(k.shape)})")
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
        max_blocks = block_size = stride_block = stride_token = stride_head = 0
        if context is not None:
            ctx_lens, table, k_cache, v_cache = context
            if len(ctx_lens) != n or table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != n:
                raise ValueError("context needs a length and an int64 block-table row per chunk")
            if (k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.stride() != v_cache.stride()
                    or k_cache.shape[2:] != k.shape[1:] or k_cache.stride(-1) != 1):
                raise ValueError(f"the cache halves must be {name} [blocks, block_size, Hk, D] of one layout, "
                                 "rows contiguous")
            table = table.contiguous()
            block_size = k_cache.shape[1]
            if any(c < 0 or (c > 0 and -(-(c + n_) // block_size) > table.shape[1]) for c, n_ in zip(ctx_lens, lens)):
                raise ValueError("a chunk runs past its block-table row")
            c_ctx = (ctypes.c_int64 * max(n, 1))(*ctx_lens)
            table_ptr, k_cache_ptr, v_cache_ptr = table.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
            max_blocks, (stride_block, stride_token, stride_head) = table.shape[1], k_cache.stride()[:3]
        _, hq, d = q.shape
        rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                out.stride(0), c_starts, c_lens, c_ctx, n, k_cache_ptr, v_cache_ptr, table_ptr, max_blocks, block_size,
                stride_block, stride_token, stride_head, hq, k.shape[1], d, scale, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("prefill attention could not allocate its scratch memory")

    return attend
