"""OLMo 2: no norm before a block and one after each (``x + norm(block(x))``), and
RMSNorm over the whole q and k projections (across heads; all-reduced under TP)."""

from __future__ import annotations

from aserve.model.models.llama import DecoderOptions, LlamaForCausalLM


class Olmo2ForCausalLM(LlamaForCausalLM):
    options = DecoderOptions(norm_layout="post", qk_norm="full")
