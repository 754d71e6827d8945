"""Mixtral: Mistral's attention with a mixture of experts in every layer, its top-k
weights always renormalised and kept in float32. The checkpoint's ``block_sparse_moe``
(``w1`` gate, ``w3`` up, ``w2`` down) loads into the shared MoE layer's names."""

from __future__ import annotations

from aserve.model.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_params = ((".block_sparse_moe.", ".mlp."),)
