"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with a mixture of experts plus a shared
expert whose output is gated by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(qkv_bias=None, o_bias=False)
