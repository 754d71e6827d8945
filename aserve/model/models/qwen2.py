"""Qwen2: Llama with biases on the q/k/v projections (and none on o_proj)."""

from __future__ import annotations

from aserve.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias_override = True
    o_bias_override = False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen2DecoderLayer
