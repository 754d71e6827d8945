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
    "Gemma2ForCausalLM": ("aserve.model.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("aserve.model.models.gemma3", "Gemma3ForCausalLM"),
    "GraniteForCausalLM": ("aserve.model.models.granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("aserve.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("aserve.model.models.llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("aserve.model.models.mixtral", "MixtralForCausalLM"),
    "Olmo2ForCausalLM": ("aserve.model.models.olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("aserve.model.models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("aserve.model.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("aserve.model.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("aserve.model.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("aserve.model.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "SmolLM3ForCausalLM": ("aserve.model.models.smollm3", "SmolLM3ForCausalLM"),
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
