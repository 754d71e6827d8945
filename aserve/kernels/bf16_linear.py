"""bf16 linear layers on AVX512-BF16 (``vdpbf16ps``), from ``cpu_bf16_linear.c``: the
form bf16 weights take on an x86 CPU with ``avx512_bf16`` and no AMX (an AMD EPYC Zen 4,
say), where they would otherwise run on oneDNN.

The kernel packs weights in the AMX kernel's layout and takes the same arguments, so it
is loaded as an :class:`~aserve.kernels.amx_linear.AmxLinear` (``kind``
``"avx512_bf16"``) and every caller of the AMX kernel (the linear layers, the MoE
experts, the one-call decode step's ``cpu_llama_decode_avx512.c``) takes it unchanged.
On two Zen 4 cores, the 152M model's 12 layers of weights: 1 row 10.6 against oneDNN's
16.9 ms, 32 rows 25.9 against 32.1 ms, 128 rows even (``docs/performance.md``).

:func:`load` returns None where the CPU lacks AVX512-BF16 (:func:`cpu_supported`), the
kernel cannot be built, or ``ASERVE_CPU_BF16_LINEAR=0``. :func:`load_best` is the kernel a
bf16 model's layers get: AMX where it runs, else this one, else None (oneDNN).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from aserve.envs import read_env
from aserve.kernels import amx_linear
from aserve.kernels.amx_linear import AmxLinear
from aserve.kernels.cbuild import cpu_flags, load_library

_SOURCE = Path(__file__).with_name("cpu_bf16_linear.c")


def cpu_supported() -> bool:
    """Whether this CPU runs the kernel: AVX-512F with AVX512-BF16."""
    return {"avx512f", "avx512_bf16"} <= (cpu_flags() or frozenset())


def load_library_checked(source: Path, what: str, available: str = "aserve_bf16_linear_available") -> ctypes.CDLL | None:
    """The library built from ``source`` (an AVX512-BF16 kernel), or None without
    AVX512-BF16, without a compiler, or when the build says (its function ``available``
    returns 0) that it was compiled without the instructions."""
    if not cpu_supported():
        return None
    return load_library(source, read_env().cache_dir / "kernels", what, available=available)


def load() -> AmxLinear | None:
    """The AVX512-BF16 kernel, or None where it is unavailable or switched off."""
    if not read_env().cpu_bf16_linear:
        return None
    lib = load_library_checked(_SOURCE, "bf16 linear layers (AVX512-BF16)")
    return None if lib is None else AmxLinear(lib, "avx512_bf16", "aserve_bf16")


def load_best() -> AmxLinear | None:
    """The bf16 kernel for this CPU: AMX, else AVX512-BF16, else None (oneDNN)."""
    return amx_linear.load() or load()
