"""Tiny Hugging Face-format models for tests, made with ``transformers`` in seconds.

Each variant covers something real checkpoints carry; all use aserve's tiny byte-level
tokenizer and fixed seeds, so every run builds the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from aserve.tiny_tokenizer import EOS, IM_END, build_tokenizer, write_tokenizer_files

VOCAB = build_tokenizer().get_vocab_size()

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, initializer_range=0.08,
)

# name -> (transformers config class name, config kwargs, how to rewrite config.json)
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    # GQA, head_dim != hidden / heads, llama3 rope in the old top-level spelling.
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  rope_theta=500000.0), "old_rope"),
    # Tied embeddings, linear rope scaling in the new rope_parameters spelling.
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
                                      sliding_window=None,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0}), "new_rope"),
    # Biases on q/k/v, tied embeddings, MQA.
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True), "new_rope"),
    # q/k RMSNorm, head_dim 32 with hidden 64, dynamic rope.
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False,
                                  rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "new_rope"),
    # Local layers of 8 tokens alternating with global ones, both soft-caps small enough
    # to bite, query_pre_attn_scalar != head_dim, GeGLU, (1 + w) norms, sqrt(hidden) embeddings.
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                    final_logit_softcapping=2.0, num_hidden_layers=3), "new_rope"),
    # Two local layers (their own rope base) to one global, per-head (1 + w) q/k norms.
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                                        sliding_window_pattern=3, num_hidden_layers=4, query_pre_attn_scalar=16,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}), "new_rope"),
    # Fused qkv_proj / gate_up_proj in the checkpoint, longrope, half of each head rotated.
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0,
                                original_max_position_embeddings=256,
                                rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2],
                                              "long_factor": [2.0, 3.0, 4.0, 5.0]}), "new_rope"),
    # Norms after each block only; q/k norms over the whole projection.
    "olmo2": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2), "new_rope"),
    "granite": ("GraniteConfig", dict(num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
                                      attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5),
                "new_rope"),
    # Layers 3 and 7 without rotary, and sliding (8 tokens) there.
    "smollm3": ("SmolLM3Config", dict(pad_token_id=0, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                                      use_sliding_window=True, sliding_window=8, no_rope_layer_interval=2),
                "new_rope"),
    # Top-2 of 4 experts, renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1], num_hidden_layers=3), "new_rope"),
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2), "new_rope"),
    # Top-2 of 4 without renormalisation, and the gated shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False), "new_rope"),
}

#: Variants whose reference runs transformers' eager attention (Gemma 2's soft-capping
#: has no SDPA form; the others' masks are simplest to trust there).
EAGER = {"gemma2", "gemma3", "smollm3"}


def build_model(name: str, out_dir: Path, *, seed: int = 0, shard: bool = False) -> Path:
    """Write variant ``name`` to ``out_dir`` (float32 weights) and return the directory."""
    import transformers

    config_class, kwargs, rope_form = VARIANTS[name]
    config = getattr(transformers, config_class)(**{**_COMMON, **kwargs})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, max_shard_size="100KB" if shard else "10GB")
    tok = write_tokenizer_files(out_dir)
    generation = {"bos_token_id": 0, "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    if rope_form == "old_rope":
        cfg = json.loads((out_dir / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
        (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


#: A ChatML template that also renders tools, assistant tool calls and tool results the
#: way Qwen's (Hermes-format) templates do, and closes the thinking when asked not to think.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{%- endif %}"""


def with_tools_template(model_dir: Path, out_dir: Path, max_positions: int = 2048) -> Path:
    """A copy of ``model_dir`` (links) whose chat template is ``TOOLS_TEMPLATE`` and whose
    config allows ``max_positions`` (tool definitions make long prompts)."""
    out_dir.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.name != "config.json":
            (out_dir / path.name).symlink_to(path)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (out_dir / "config.json").write_text(json.dumps(config))
    (out_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out_dir


#: What the scripted model says after "<|im_start|>assistant\n": think, then answer.
SCRIPT = ["<think>", "a", "b", "</think>", "c"]


def build_scripted_model(out_dir: Path) -> Path:
    """A Llama whose greedy reply is ``SCRIPT`` then EOS, whatever the prompt.

    Every layer's output projections are zero, so each position's hidden state is its
    token's embedding; the script's tokens get one-hot embeddings and the LM head maps
    each to the next one with a large logit (every other token scores 0). ``<think>`` and
    ``</think>`` are added, non-special tokens (as in Qwen 3's tokenizer), so they stay
    in the text the reasoning parsers read. Under a grammar the script's token is taken
    where the grammar allows it, else the lowest allowed id.
    """
    import transformers
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": vocab, "max_position_embeddings": 2048},
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = [tok.encode("\n", add_special_tokens=False).ids[-1]] + [tok.token_to_id(t) for t in SCRIPT] + [
        tok.token_to_id(EOS)]
    assert len(set(ids)) == len(ids) and None not in ids
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, successor) in enumerate(zip(ids, ids[1:])):
            model.model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[successor, i] = 40.0
    model.save_pretrained(out_dir)
    write_tokenizer_files(out_dir, tok)
    (out_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    generation = {"bos_token_id": 0, "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    return out_dir
