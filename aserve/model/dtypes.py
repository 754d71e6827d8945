"""Model dtypes by name, without torch.

The engine core and the API server size the KV cache and check a request's model
before any weight is loaded, in processes that never import torch (it would cost each
of them ~140 MiB of resident memory); only the workers map these names to
``torch.dtype``.
"""

from __future__ import annotations

from aserve.errors import CorruptModelFileError
from aserve.kernels.cbuild import cpu_flags
from aserve.model.hf_config import ArchConfig

#: bytes per element of each supported dtype
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
#: x86 flags, any one of which gives torch (oneDNN) native matrix products in the dtype
_NATIVE_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}


def cpu_half_dtypes(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The half dtypes this x86 CPU multiplies natively, from ``/proc/cpuinfo`` (or the
    text given); None where that cannot be told (no ``flags`` line: not x86, or no /proc)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    return frozenset(name for name, needs in _NATIVE_FLAGS.items() if flags & needs)


def resolve_dtype_name(requested: str, arch: ArchConfig, native_half: frozenset[str] | None = None) -> str:
    """An explicit dtype as given. ``auto`` takes the checkpoint's dtype (float32 when it
    names none), except a half dtype that ``native_half`` (the CPU's, see
    :func:`cpu_half_dtypes`; None: unknown, keep the checkpoint's) does not list: that
    computes in float32. Without native support torch multiplies bf16 4-8x slower than
    float32 (an AVX2 CPU, docs/configuration.md), so auto trades memory for speed, as
    transformers does by loading float32 unless told otherwise."""
    if requested != "auto":
        return requested
    name = str(arch.torch_dtype or "float32").removeprefix("torch.")
    if name not in ITEMSIZE:
        raise CorruptModelFileError(f"config.json names dtype {arch.torch_dtype!r}; expected one of {sorted(ITEMSIZE)}")
    if name != "float32" and native_half is not None and name not in native_half:
        return "float32"
    return name
