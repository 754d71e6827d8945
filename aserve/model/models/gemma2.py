"""Gemma 2: norms before and after each block, all scaling by ``1 + weight``; embeddings
times sqrt(hidden); GeGLU; the attention scaled by ``query_pre_attn_scalar``; local
(sliding-window) and global layers alternating, layer 0 local; attention logits and
final logits soft-capped (``hf_config`` reads the caps and windows)."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(norm_layout="sandwich", norm_offset=1.0, embed_scale_sqrt_hidden=True)
