"""Phi-3 (and Phi-4-mini): Llama whose checkpoint stores q/k/v as one ``qkv_proj`` and
gate/up as one ``gate_up_proj`` (each rank reads its rows of every part), with longrope
scaling and, on Phi-4-mini, partial rotary (``aserve.model.layers.rotary``)."""

from __future__ import annotations

from typing import Any

from aserve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params = ()

    @classmethod
    def checkpoint_param(cls, name: str) -> tuple[str, Any]:
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            return name, "fused"
        return super().checkpoint_param(name)
