"""Qwen2: Llama with biases on the q/k/v projections (and none on o_proj); sliding
windows from ``max_window_layers`` on when ``use_sliding_window`` (``hf_config``)."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(qkv_bias=True, o_bias=False)
