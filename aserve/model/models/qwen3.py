"""Qwen3: Llama with RMSNorm over each head of q and k before the rotary embedding."""

from __future__ import annotations

from aserve.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
