"""Model dtypes by name, without torch.

The engine core and the API server size the KV cache and check a request's model
before any weight is loaded, in processes that never import torch (it would cost each
of them ~140 MiB of resident memory); only the workers map these names to
``torch.dtype``.
"""

from __future__ import annotations

from aserve.errors import CorruptModelFileError
from aserve.model.hf_config import ArchConfig

#: bytes per element of each supported dtype
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_dtype_name(requested: str, arch: ArchConfig) -> str:
    """``auto`` takes the checkpoint's dtype (float32 when it names none)."""
    if requested != "auto":
        return requested
    name = str(arch.torch_dtype or "float32").removeprefix("torch.")
    if name not in ITEMSIZE:
        raise CorruptModelFileError(f"config.json names dtype {arch.torch_dtype!r}; expected one of {sorted(ITEMSIZE)}")
    return name
