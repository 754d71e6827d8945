"""Builds a model from a Hugging Face directory and fills it from safetensors.

Tensors are read one at a time, and each parameter reads only its own shard through a
slice of the file (``safe_open(...).get_slice``), so neither a whole file nor a whole
tensor that a rank does not own is ever held in memory twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from aserve.distributed.tp_group import TPGroup
from aserve.errors import ConfigError, CorruptModelFileError
from aserve.model.checkpoint import safetensors_files
from aserve.model.dtypes import resolve_dtype_name
from aserve.model.hf_config import ArchConfig
from aserve.model.pipeline import Stage
from aserve.model.registry import resolve_model_class


def resolve_dtype(requested: str, arch: ArchConfig) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float32 when it names none)."""
    return getattr(torch, resolve_dtype_name(requested, arch))


class _SafetensorsSource:
    def __init__(self, handle, name: str) -> None:  # noqa: ANN001 (safetensors' handle has no public type)
        self._handle = handle
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(self.name).get_shape())

    def read(self, *slices: slice) -> torch.Tensor:
        if not slices:
            return self._handle.get_tensor(self.name)
        return self._handle.get_slice(self.name)[slices]


def _iter_sources(files: list[Path], stack: ExitStack) -> Iterator[_SafetensorsSource]:
    for path in files:
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
        except (SafetensorError, OSError) as exc:
            raise CorruptModelFileError(f"{path} is not a readable safetensors file: {exc}") from exc
        for name in handle.keys():
            yield _SafetensorsSource(handle, name)


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                total += len(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise CorruptModelFileError(f"{path} is not a readable safetensors file: {exc}") from exc
    return total


def load_model(model_dir: Path, arch: ArchConfig, *, dtype: torch.dtype, max_positions: int, tp: TPGroup,
               progress: Callable[[int, int], None] | None = None, stage: Stage | None = None) -> nn.Module:
    """Construct the architecture's model for this rank and load its weights.

    ``progress(done, total)`` is called after each tensor, when given. ``stage``: the
    pipeline stage this rank holds (default: all of it); tensors of other stages are
    skipped unread.

    Raises ``UnsupportedArchitectureError``, ``ModelFileNotFoundError`` or
    ``CorruptModelFileError`` (a tensor missing, misshapen or unreadable).
    """
    model_class = resolve_model_class(arch.architecture)
    try:
        model = model_class(arch, max_positions=max_positions, tp=tp, dtype=dtype, stage=stage)
    except ValueError as exc:  # shapes that do not divide over the TP size
        raise ConfigError(str(exc)) from exc
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = safetensors_files(model_dir)
    total = count_tensors(files) if progress is not None else 0
    with ExitStack() as stack:
        for done, source in enumerate(_iter_sources(files, stack), start=1):
            if progress is not None:
                progress(done, total)
            name = source.name
            if "rotary_emb" in name:
                continue
            if arch.tie_word_embeddings and name == "lm_head.weight":
                continue
            name, shard_id = model_class.checkpoint_param(name)
            param = params.get(name)
            if param is None and stage is not None and not stage.holds(name, tied_embeddings=arch.tie_word_embeddings):
                continue  # another pipeline stage's
            if param is None:
                raise CorruptModelFileError(f"{source.name} in the checkpoint has no place in {arch.architecture}")
            try:
                param.weight_loader(param, source, shard_id)
            except SafetensorError as exc:
                raise CorruptModelFileError(f"cannot read tensor {source.name}: {exc}") from exc
            loaded.add(name)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if arch.tie_word_embeddings else set()))
    if missing:
        raise CorruptModelFileError(f"the checkpoint in {model_dir} lacks tensors: {', '.join(missing[:5])}")
    return model.eval()
