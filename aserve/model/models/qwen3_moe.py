"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of experts as the MLP
of every sparse layer (``decoder_sparse_step``, ``mlp_only_layers``); softmax top-k
routing, renormalised when ``norm_topk_prob`` (``aserve.model.layers.moe``)."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(qk_norm="head")
