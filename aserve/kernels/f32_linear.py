"""float32 linear layers over a packed weight, from ``cpu_f32_linear.c``, in an AVX-512
form and an AVX2 + FMA form (the build has the widest the CPU runs).

The form float32 weights take on an x86 CPU with AVX2 (before it: small ones used MKL
over a transposed copy, large ones oneDNN on a prepacked copy): the weight is packed once
into panels of 16 output columns and kept only in that form (but for an LM head tied to
the embedding). The AVX2 form, on the 7M model's weights on one Zen 3 core, runs 1.2-1.6x
MKL's rate at decode batch sizes and about even at prefill sizes; on the 152M model's, two
cores, 1.2-1.3x oneDNN's at every batch size measured (8, 32, 2,048 rows). The AVX-512
form, on an AMX Xeon's core, matches or beats MKL at decode sizes, where the AVX2 form ran
at 0.6-0.75x of it (``docs/performance.md``). Both forms give the same bits. The float32
one-call decode step (``cpu_llama_decode_f32.c``) calls the same kernel, so the two paths
agree bit for bit.

:func:`load` returns None where the kernel cannot be built, the CPU lacks AVX2 or FMA
(:func:`cpu_supported`), or ``ASERVE_CPU_F32_LINEAR=0``; the layers then keep oneDNN and
MKL. :func:`form` says which form this CPU's build runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.cbuild import cpu_flags, load_library

_SOURCE = Path(__file__).with_name("cpu_f32_linear.c")


class F32Linear:
    """The loaded kernel: :meth:`pack` a weight once, then :meth:`linear` per call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.aserve_f32_linear_form.restype = ctypes.c_int
        #: The vector width this build runs: 512 (AVX-512F) or 256 (AVX2 + FMA).
        self.form = lib.aserve_f32_linear_form()
        self._numel = lib.aserve_f32_packed_numel
        self._numel.argtypes = [i64, i64]
        self._numel.restype = i64
        self._pack = lib.aserve_f32_pack
        self._pack.argtypes = [ptr, i64, i64, ptr]
        self._pack.restype = None
        self._linear = lib.aserve_f32_linear
        self._linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
        self._linear.restype = ctypes.c_int

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` ([out, in], float32, on CPU, rows contiguous) can be packed."""
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] > 0 and weight.shape[1] > 0 and weight.stride(1) == 1)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (1-D float32; the layout is in the C file)."""
        assert self.supports(weight)
        n, k = weight.shape
        out = torch.empty(self._numel(n, k), dtype=torch.float32)  # torch aligns it to 64 bytes
        self._pack(weight.contiguous().data_ptr(), n, k, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for ``x`` [rows, in] float32 (rows may be strided) and W's
        :meth:`pack` ed copy; returns a new [rows, out_features] tensor."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        y = torch.empty(rows, out_features, dtype=torch.float32)
        if rows:
            code = self._linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, rows,
                                out_features, in_features, torch.get_num_threads())
            if code != 0:
                raise RuntimeError("the float32 linear kernel is not built for this CPU")
        return y


def cpu_supported(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or ``flags``) runs the kernel: AVX2 and FMA (an AVX-512 CPU runs
    its AVX-512 form)."""
    flags = cpu_flags() if flags is None else flags
    return flags is not None and {"avx2", "fma"} <= flags


def load(extra_flags: tuple[str, ...] = ()) -> F32Linear | None:
    """The kernel, or None where it is unavailable or switched off. ``extra_flags``: for
    the compiler (tests build the AVX2 form on an AVX-512 CPU with ``-mno-avx512f``)."""
    env = read_env()
    if not env.cpu_f32_linear or not cpu_supported():
        return None
    lib = load_library(_SOURCE, env.cache_dir / "kernels", "float32 linear layers", extra_flags,
                       available="aserve_f32_linear_available")
    return None if lib is None else F32Linear(lib)
