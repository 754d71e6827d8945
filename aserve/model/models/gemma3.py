"""Gemma 3 (text): Gemma 2's layer without soft-capped attention, with per-head q/k norms
(``1 + weight`` too), five local layers to each global one, and the local layers'
rotary on their own base (``rope_parameters.sliding_attention``)."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Gemma3ForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(norm_layout="sandwich", norm_offset=1.0, qk_norm="head", embed_scale_sqrt_hidden=True)
