"""Applies structured outputs' packed token masks to a step's logits (``cpu_token_mask.c``),
with :func:`apply_token_bitmask_numpy` as its plain twin.

A mask row is llguidance's layout: int32 words, bit ``t % 32`` of word ``t // 32`` set
where token ``t`` may be sampled. Masking writes -inf over every other token; a row left
with nothing finite (``min_tokens`` or a penalty masked all the grammar allows) gets 0.0
on the grammar's tokens instead, so the grammar wins.

:func:`load` returns None where the kernel cannot be built (no compiler) or the C kernels
are switched off (``ASERVE_CPU_FUSED_OPS=0``); callers then use the twin.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from aserve.envs import read_env
from aserve.kernels.cbuild import load_library

_SOURCE = Path(__file__).with_name("cpu_token_mask.c")


def apply_token_bitmask_numpy(logits: np.ndarray, rows: list[int], bits: np.ndarray) -> int:
    """Mask rows ``rows`` of ``logits`` ([N, V] float32, in place) by ``bits`` ([k, words]
    int32, one mask row per entry of ``rows``); returns how many rows were left with
    nothing finite (and got 0.0 on their allowed tokens)."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(bool)[:, :vocab]
    width = allowed.shape[1]
    sub = logits[rows]  # [k, V], a copy
    sub[:, :width][~allowed] = -np.inf
    sub[:, width:] = -np.inf
    dead = np.isneginf(sub.max(axis=1))
    if dead.any():
        sub[dead] = -np.inf
        sub[dead, :width] = np.where(allowed[dead], 0.0, -np.inf)
    logits[rows] = sub
    return int(dead.sum())


class TokenMaskKernel:
    """The loaded kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._apply = lib.aserve_apply_token_bitmask
        self._apply.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64]
        self._apply.restype = i64

    def apply(self, logits: torch.Tensor, rows: list[int], bits: np.ndarray) -> int:
        """:func:`apply_token_bitmask_numpy` on ``logits`` ([N, V] float32 CPU tensor whose
        rows are contiguous), in place, in one call."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
            raise ValueError("token masks apply to float32 CPU logits with contiguous rows")
        bits = np.ascontiguousarray(bits, dtype=np.int32)
        if bits.shape[0] != len(rows) or (rows and (min(rows) < 0 or max(rows) >= logits.shape[0])):
            raise ValueError("one mask row per logits row, each row in range")
        index = np.asarray(rows, dtype=np.int64)
        return int(self._apply(logits.data_ptr(), logits.stride(0), logits.shape[1], index.ctypes.data, len(rows),
                               bits.ctypes.data, bits.shape[1]))


def load() -> TokenMaskKernel | None:
    """The kernel, or None where it is unavailable or the C kernels are switched off."""
    env = read_env()
    if not env.cpu_fused_ops:
        return None
    lib = load_library(_SOURCE, env.cache_dir / "kernels", "structured outputs' token masks")
    return None if lib is None else TokenMaskKernel(lib)
