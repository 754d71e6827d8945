"""Qwen3: Llama with RMSNorm over each head of q and k before the rotary embedding."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(qk_norm="head")
