"""Writes Hugging Face-format Llama-family directories with random weights.

Used by the benchmark scripts and by tests that do not need ``transformers`` (the
default model ``aserve run`` serves is a trained one: ``aserve.default_model``). The result loads in aserve and in ``transformers`` alike.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aserve.tiny_tokenizer import EOS, IM_END, build_tokenizer, write_tokenizer_files

if TYPE_CHECKING:  # torch is imported where weights are made: the server's front end runs without it
    import torch


def llama_config(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                 vocab_size: int, max_position_embeddings: int = 4096, dtype: str = "float32",
                 tie_word_embeddings: bool = False, architecture: str = "LlamaForCausalLM", **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                       "Qwen3MoeForCausalLM": "qwen3_moe"}[architecture],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": dtype,
        **extra,
    }


def random_llama_weights(cfg: dict[str, Any], *, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A Llama state dict in the checkpoint's names, normal(0, std) weights, unit norms."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg["dtype"])
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    weights = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    if not cfg.get("tie_word_embeddings"):
        weights["lm_head.weight"] = rand(vocab, h)
    return weights


def write_model_dir(model_dir: Path, cfg: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Write config, generation config, weights and the tiny tokenizer into ``model_dir``."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer_files(model_dir)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    generation = {"bos_token_id": 0, "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


# The embedded default: the 7M-parameter shape used in the benchmarks (256 hidden, 4 layers).
DEFAULT_MODEL_NAME = "default-llama-7m-v1"


def default_model_config() -> dict[str, Any]:
    vocab = build_tokenizer().get_vocab_size()
    return llama_config(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
                        vocab_size=vocab, max_position_embeddings=4096)


def ensure_default_model(cache_dir: Path) -> Path:
    """The random 7M test model's directory (the benchmarks' 7M shape), built on first use
    into ``cache_dir`` (atomically, in a second or so). Its text is nonsense; tests use it
    as the control against the trained default model, and where any model will do."""
    target = cache_dir / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        cfg = default_model_config()
        write_model_dir(staging, cfg, random_llama_weights(cfg, seed=0))
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished first; its copy is identical.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
