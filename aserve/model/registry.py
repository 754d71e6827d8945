"""Architecture name (``config.json``'s ``architectures[0]``) -> model class.

The classes are imported on first use: ``check_architecture`` lets the torch-free
processes (engine core, API server) refuse an unknown architecture without importing
the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from aserve.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from torch import nn

#: architecture name -> (module, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("aserve.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("aserve.model.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("aserve.model.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("aserve.model.models.qwen3", "Qwen3ForCausalLM"),
}


def check_architecture(architecture: str) -> None:
    """Raise ``UnsupportedArchitectureError``, naming the supported ones, unless
    ``architecture`` is registered."""
    if architecture not in MODEL_REGISTRY:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: {supported}"
        )


def resolve_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
