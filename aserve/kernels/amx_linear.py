"""bf16 linear layers on Intel AMX tiles, from ``cpu_amx_linear.c``.

At decode batch sizes a linear layer's time is the time to stream its weight from
memory; this kernel streams a pre-tiled copy (the only copy kept, but for an LM head
tied to the embedding) with one contiguous run per thread, and serves prefill-sized
batches about as fast as oneDNN by keeping groups of weight tiles in L2 while the
batch's rows pass. Measured on this machine's
two cores, 152M-model shapes, weights not in cache: 32 rows 20.5 against 23.6 ms for
12 layers (oneDNN, prepacked; 14.1 ms with the weights on 2 MiB pages, as
:func:`huge_page_arena` gives them), 8 rows 2.5 against 4.3 ms for 3 layers, 2048 rows
even.

:func:`load` returns None where the CPU has no AMX, the OS refuses the tile state, the
kernel cannot be built, or ``ASERVE_CPU_AMX=0``; the layers then keep oneDNN.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.cbuild import cpu_flags, load_library

_SOURCE = Path(__file__).with_name("cpu_amx_linear.c")
_HUGE_PAGE = 2 << 20


def padded_width(rows: int) -> int:
    """``rows`` (a weight's output side) rounded up to the 32 output columns of a tile pair:
    the width of a row of the kernel's output."""
    return -(-rows // 32) * 32


class AmxLinear:
    """The loaded kernel: :meth:`pack` a weight once, then :meth:`linear` per call.

    Also the AVX512-BF16 kernel's class (:mod:`aserve.kernels.bf16_linear`): it packs
    weights in the same layout and takes the same arguments, under the symbol prefix
    ``aserve_bf16``. ``kind`` names the one loaded: ``"amx"`` or ``"avx512_bf16"``."""

    def __init__(self, lib: ctypes.CDLL, kind: str = "amx", prefix: str = "aserve_amx") -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.kind = kind
        self._pack = getattr(lib, f"{prefix}_pack")
        self._pack.argtypes = [ptr, i64, ptr, i64, i64]
        self._pack.restype = None
        self._linear = getattr(lib, f"{prefix}_linear")
        self._linear.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        # The gated MLP's first half in one pass (see linear_silu).
        self._linear_silu = getattr(lib, f"{prefix}_linear_silu", None)
        if self._linear_silu is not None:
            self._linear_silu.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
            self._linear_silu.restype = ctypes.c_int

    def fuses_silu(self, out_features: int) -> bool:
        """Whether :meth:`linear_silu` takes a ``[gate; up]`` weight of ``out_features``
        rows: this kernel has the fused form, and each half is whole 32-column pairs."""
        return self._linear_silu is not None and out_features % 64 == 0 and out_features > 0

    def fused_silu_pays(self, rows: int, in_features: int) -> bool:
        """Whether :meth:`linear_silu` beats the two calls for ``rows`` of
        ``in_features``. The AVX512-BF16 kernel: at every size measured (its item is the
        plain product's group of two pairs either way; Zen 4, 2026-12-06, a layer, two
        threads: the 152M MLP at 32 rows 1.043 -> 0.997 ms, 128 rows 3.81 -> 3.76, 2,048
        rows 60.0 -> 56.7; K = 256, 704 wide, at 32 rows 0.083 -> 0.070, 4,096 rows 8.85
        -> 8.07). AMX: :meth:`amx_fused_silu_pays`."""
        return self.kind != "amx" or self.amx_fused_silu_pays(rows, in_features)

    @staticmethod
    def amx_fused_silu_pays(rows: int, in_features: int) -> bool:
        """Whether the AMX kernel's :meth:`linear_silu` beats its two calls for ``rows``
        of ``in_features``. Measured on the AMX machine, two threads, a layer: the 152M
        MLP (K = 1,024, 2 x 2,816 outputs) at 2,048 rows 12.3-12.9 -> 11.7-11.8 ms, at
        1,024 rows 6.53 -> 6.31, at 512 even (3.21 against 3.27); K = 512 at 2,048 rows
        even (3.47 against 3.36); the 7M MLP (K = 256) slower at 2,048 and 4,096 rows
        (0.90 -> 1.03, 1.77 -> 2.09): at small K the two-call form's larger groups read
        x fewer times."""
        return rows >= 1024 and in_features >= 1024

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` ([out, in], bf16, on CPU) can be tiled: ``in`` a multiple
        of 32. Any ``out`` can: :meth:`pack` pads it with zero rows to a multiple of 32."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] > 0 and weight.shape[1] % 32 == 0 and weight.stride(1) == 1)

    @staticmethod
    def packed_numel(weight: torch.Tensor) -> int:
        """Elements of :meth:`pack`'s copy: ``out`` rounded up to 32, times ``in``."""
        return padded_width(weight.shape[0]) * weight.shape[1]

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tiled copy of ``weight`` (see the C file for the layout), of
        :meth:`packed_numel` elements; written into ``out`` (1-D bf16, contiguous) when
        given, e.g. a slice of :func:`huge_page_arena`."""
        assert self.supports(weight)
        numel = self.packed_numel(weight)
        if out is None:
            out = torch.empty(numel, dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.numel() == numel
        rows, cols = weight.shape
        if rows % 32:
            # Zero rows up to the next tile pair: their outputs are computed and dropped.
            padded = torch.zeros(numel // cols, cols, dtype=torch.bfloat16)
            padded[:rows] = weight
            weight = padded
        self._pack(weight.data_ptr(), weight.stride(0), out.data_ptr(), weight.shape[0], cols)
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for ``x`` [rows, in] bf16 (rows may be strided) and W's
        :meth:`pack` ed copy; returns a new [rows, out_features] tensor (a view of
        rows ``out_features`` rounded up to 32 apart when W was padded)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        width = padded_width(out_features)
        y = torch.empty(rows, width, dtype=torch.bfloat16)
        if rows:
            code = self._linear(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), width, rows,
                                width, in_features, torch.get_num_threads())
            if code != 0:
                raise ValueError(f"{self.kind} linear: unsupported shape [{rows}, {in_features}] x [{out_features}, {in_features}]")
        if width != out_features:
            y = y[:, :out_features]
        return y if bias is None else y.add_(bias)

    def linear_silu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(x @ W_gate^T) * (x @ W_up^T)`` for ``x`` [rows, in] bf16 and the
        :meth:`pack` ed copy of ``W = [gate; up]`` ([2 inter, in], ``fuses_silu(2 *
        inter)``): the bits of :meth:`linear` followed by the C ``silu_mul``, without
        the [rows, 2 inter] product ever in memory. Returns a new [rows, inter] tensor."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        y = torch.empty(rows, inter, dtype=torch.bfloat16)
        if rows:
            code = self._linear_silu(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), inter, rows, inter,
                                     in_features, torch.get_num_threads())
            if code != 0:
                raise ValueError(f"{self.kind} linear_silu: unsupported shape [{rows}, {in_features}] x "
                                 f"[{2 * inter}, {in_features}] (or no scratch memory)")
        return y


def huge_page_arena(numel: int) -> torch.Tensor:
    """``numel`` bf16 elements of private anonymous memory that the kernel may back with
    2 MiB pages (``MADV_HUGEPAGE``), starting on a 2 MiB boundary.

    Why: the kernel streams each weight once per step, and with 4 KiB pages every
    second 2 KiB block crosses a page (a TLB miss, and the hardware prefetchers stop
    at page boundaries): the 152M model's 12 layers at 32 rows took 18.5 ms from 4 KiB
    pages, 14.1 ms from huge pages (C harness, two threads). The tensor keeps the
    mapping alive."""
    nbytes = numel * 2
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes].view(torch.bfloat16)


def cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16"} <= (cpu_flags() or frozenset())


def load_amx_library(source: Path, cache_dir: Path, what: str) -> ctypes.CDLL | None:
    """The library built from ``source`` (a kernel on AMX tiles, exporting
    ``aserve_amx_init``), with the tile state granted to this process; None without AMX,
    without a compiler, or when Linux refuses the tile state."""
    if not cpu_has_amx():
        return None
    lib = load_library(source, cache_dir, what)
    if lib is None:
        return None
    lib.aserve_amx_init.restype = ctypes.c_int
    return lib if lib.aserve_amx_init() else None


def load() -> AmxLinear | None:
    """The kernel, or None where it is unavailable or switched off."""
    env = read_env()
    if not env.cpu_amx:
        return None
    lib = load_amx_library(_SOURCE, env.cache_dir / "kernels", "bf16 linear layers (AMX)")
    return None if lib is None else AmxLinear(lib)
