"""SmolLM3: Llama in which every fourth layer (``no_rope_layers``) attends without rotary
(NoPE); with ``use_sliding_window`` those layers also slide (``hf_config``)."""

from __future__ import annotations

from aserve.model.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    pass
