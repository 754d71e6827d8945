"""Architecture name (``config.json``'s ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from aserve.errors import UnsupportedArchitectureError
from aserve.model.models.llama import LlamaForCausalLM, MistralForCausalLM
from aserve.model.models.qwen2 import Qwen2ForCausalLM
from aserve.model.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: {supported}"
        ) from None
