"""A checkpoint's safetensors files, found and checked without torch.

:func:`check_checkpoint` reads each file's header (8 bytes of length, then JSON) and
checks that it parses and that every tensor's bytes lie inside the file, so a truncated
download or a file that is not safetensors at all is refused, naming the file, before
any process starts, rather than by a worker half-way through loading.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from aserve.errors import CorruptModelFileError, ModelFileNotFoundError

#: safetensors' dtype names and their sizes in bytes.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: safetensors' own limit on the header.
_MAX_HEADER_BYTES = 100 << 20


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: a single file, or the shards its index lists."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptModelFileError(f"{index} is not a valid safetensors index ({exc!r}): re-download "
                                        "the model") from exc
        files = [model_dir / name for name in names]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileNotFoundError(f"no *.safetensors weights in {model_dir}: aserve loads safetensors "
                                     "checkpoints only")
    for path in files:
        if not path.is_file():
            raise ModelFileNotFoundError(f"weight shard {path.name} listed in the index is missing from {model_dir}")
    return files


def check_checkpoint(model_dir: Path) -> list[Path]:
    """The checkpoint's files, each one's header checked; raises ``ModelFileNotFoundError``
    or ``CorruptModelFileError`` naming the file."""
    files = safetensors_files(model_dir)
    for path in files:
        _check_file(path)
    return files


def _check_file(path: Path) -> None:
    def corrupt(why: str) -> CorruptModelFileError:
        return CorruptModelFileError(f"{path} is not a valid safetensors file ({why}): re-download or re-convert it")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"{size} bytes, shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise corrupt(f"a header of {length} bytes in a file of {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise corrupt(f"its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = 1
            for dim in shape:
                numel *= int(dim)
            itemsize = _ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {name!r} has a malformed entry") from None
        if not 0 <= begin <= end <= data_bytes:
            raise corrupt(f"tensor {name!r} lies at bytes {begin}..{end} of {data_bytes}: the file is truncated")
        if end - begin != numel * itemsize:
            raise corrupt(f"tensor {name!r} has {end - begin} bytes for shape {shape} of {dtype}")
