"""How a parameter learns its shard: each parameter carries a ``weight_loader``.

The loader hands a parameter a :class:`TensorSource` (a lazily read tensor from a
checkpoint) and, for merged parameters, the id of the part it holds (``"q"``, ``"k"``,
``"v"``, or an index). The parameter reads only the rows or columns it owns, so a
tensor-parallel rank never materialises a full weight.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from aserve.errors import CorruptModelFileError


class TensorSource(Protocol):
    """A tensor in a checkpoint that is read only when sliced."""

    name: str

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, *slices: slice) -> torch.Tensor:
        """The tensor, or the part selected by one slice per leading dimension."""
        ...


WeightLoader = Callable[..., None]


def new_param(*shape: int, dtype: torch.dtype, loader: WeightLoader | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter: every value comes from the checkpoint."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or default_weight_loader  # type: ignore[attr-defined]
    return param


def check_shape(param_part: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param_part.shape) != tuple(loaded.shape):
        raise CorruptModelFileError(
            f"tensor {name} has shape {tuple(loaded.shape)} but the config implies {tuple(param_part.shape)}"
        )


def expect_full_shape(source: TensorSource, shape: tuple[int, ...]) -> None:
    """Check a checkpoint tensor's full shape before reading a shard of it."""
    if tuple(source.shape) != tuple(shape):
        raise CorruptModelFileError(
            f"tensor {source.name} has shape {tuple(source.shape)} but the config implies {tuple(shape)}"
        )


def default_weight_loader(param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
    """Copy the whole tensor (replicated parameters: norms, biases of row-parallel layers)."""
    loaded = source.read()
    check_shape(param, loaded, source.name)
    param.data.copy_(loaded)
