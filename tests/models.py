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
}


def build_model(name: str, out_dir: Path, *, seed: int = 0, shard: bool = False) -> Path:
    """Write variant ``name`` to ``out_dir`` (float32 weights) and return the directory."""
    import transformers

    config_class, kwargs, rope_form = VARIANTS[name]
    config = getattr(transformers, config_class)(**_COMMON, **kwargs)
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
