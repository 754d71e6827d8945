"""Builds and calls the fused element-wise C kernels (``cpu_fused_ops.c``) on CPU:
RMSNorm with its residual add, SiLU(gate) * up and rotary, each one call instead of several
small torch ops (the ops' dispatch, not their arithmetic, dominates at decode batch
sizes).

:func:`load` returns None where the kernels cannot be built (no compiler) or are
switched off (``ASERVE_CPU_FUSED_OPS=0``); the layers then keep their torch forms.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.cbuild import load_library

_SOURCE = Path(__file__).with_name("cpu_fused_ops.c")
MAX_HIDDEN = 65536


class FusedOps:
    """The loaded kernels. Inputs are float32 or bfloat16 CPU tensors whose last
    dimension is contiguous; the layers check what they pass (:meth:`supports`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._rms = lib.aserve_rms_norm
        self._rms.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._rms.restype = ctypes.c_int
        self._silu = lib.aserve_silu_mul
        self._silu.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_int, ctypes.c_int]
        self._silu.restype = ctypes.c_int
        self._rotary = lib.aserve_rotary
        self._rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._rotary.restype = ctypes.c_int
        self._write_kv = lib.aserve_write_kv
        self._write_kv.argtypes = [ptr] * 4 + [i64] * 4 + [ptr] + [i64] * 9 + [ctypes.c_int]
        self._write_kv.restype = ctypes.c_int

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether ``x`` ([rows, n], rows strided, last dim contiguous) can be passed."""
        return (x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.dim() == 2
                and x.stride(1) == 1 and x.shape[1] <= MAX_HIDDEN)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(norm(x + residual), x + residual)``, or ``(norm(x), None)`` without a residual.

        ``x`` and ``residual``: [rows, hidden] in the same dtype; ``weight``: [hidden],
        contiguous."""
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=x.dtype)
        res_out = None if residual is None else torch.empty(rows, hidden, dtype=x.dtype)
        self._rms(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                  0 if residual is None else residual.stride(0), None if res_out is None else res_out.data_ptr(),
                  weight.data_ptr(), out.data_ptr(), rows, hidden, eps, int(x.dtype == torch.bfloat16),
                  torch.get_num_threads())
        return out, res_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` = [rows, 2 * inter] (gate first)."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2,
                   int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] in place (heads and rows may be strided, D contiguous)
        by ``cos`` / ``sin`` ([T, D/2] contiguous, x's dtype); returns ``x``."""
        tokens, heads, dim = x.shape
        self._rotary(x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, dim, cos.data_ptr(), sin.data_ptr(),
                     int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return x

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """:func:`aserve.kernels.attention.write_kv` in one call: ``k`` and ``v`` ([T, Hk,
        D], rows and heads may be strided, D contiguous) into slots ``slot_mapping``
        (int64) of ``kv_cache`` ([2, blocks, block_size, Hk, D], CPU, any strides with D
        contiguous), converted to the cache's dtype. A slot outside the pool raises
        IndexError and writes nothing."""
        _, blocks, block_size, hk, d = kv_cache.shape
        if kv_cache.stride(-1) != 1 or k.shape != (k.shape[0], hk, d) or v.shape != k.shape:
            raise ValueError(f"write_kv needs [T, {hk}, {d}] keys and values and a cache with rows contiguous")
        k, v = (x.to(kv_cache.dtype) if x.stride(-1) == 1 else x.to(kv_cache.dtype).contiguous() for x in (k, v))
        slots = slot_mapping.to(torch.int64).contiguous()
        s_block, s_token, s_head, _ = kv_cache[0].stride()
        rc = self._write_kv(kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), slots.data_ptr(), blocks * block_size, k.shape[0],
                            hk, d, kv_cache.element_size(), block_size, s_block, s_token, s_head,
                            torch.get_num_threads())
        if rc != 0:
            raise IndexError(f"a KV slot lies outside the pool of {blocks * block_size} slots")


def load() -> FusedOps | None:
    """The kernels, or None where they are unavailable or switched off."""
    env = read_env()
    if not env.cpu_fused_ops:
        return None
    lib = load_library(_SOURCE, env.cache_dir / "kernels", "RMSNorm, SiLU, rotary and the KV writes")
    return None if lib is None else FusedOps(lib)


def attach(model: torch.nn.Module, ops: FusedOps) -> int:
    """Give every module of ``model`` that declares a ``fused_ops`` slot (RMSNorm, the
    MLPs, the rotary embedding) the kernels; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(type(module), "fused_ops"):
            module.fused_ops = ops
            count += 1
    return count
