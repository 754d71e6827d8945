"""Granite: Llama with an embedding multiplier, ``attention_multiplier`` as the attention
scale, each block's output times ``residual_multiplier`` before the residual add, and
logits divided by ``logits_scaling`` (all read by ``hf_config``)."""

from __future__ import annotations

from aserve.model.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    pass
