#!/usr/bin/env python3
"""Writes the benchmark Llama models (random weights, fixed seed) in Hugging Face format.

    python scripts/make_bench_model.py OUT_DIR [--size 152m|7m|1b|moe-150m|dense-52m]

152m: hidden 1024, 12 layers, 16 heads, intermediate 2816 (~155M parameters with
aserve's tiny tokenizer). 1b: hidden 2048, 16 layers, 32 heads on 8 KV heads,
intermediate 8192 (~1.0B; the CUDA check's large model). 7m: hidden 256, 4 layers (the embedded default's shape).
moe-150m: a Qwen3-MoE, hidden 768, 8 layers, 12 heads on 4 KV heads, 8 experts of width
896, top 2 renormalised (151M parameters, 52M active per token); dense-52m: the Qwen3 of
the same attention whose MLP (width 1792) matches two experts, i.e. the MoE's active
size. The MoE's experts are written one tensor each, as the Hub's checkpoints are.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aserve.model_builder import default_model_config, llama_config, random_llama_weights, write_model_dir
from aserve.tiny_tokenizer import build_tokenizer


MOE_SHAPE = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, vocab_size=build_tokenizer().get_vocab_size(),
                 max_position_embeddings=4096)


def config_for(size: str) -> dict:
    if size == "7m":
        return default_model_config()
    if size == "moe-150m":
        return llama_config(**MOE_SHAPE, intermediate_size=1792, architecture="Qwen3MoeForCausalLM",
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=896, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[])
    if size == "1b":
        return llama_config(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                            vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=4096,
                            dtype="bfloat16")
    if size == "dense-52m":
        return llama_config(**MOE_SHAPE, intermediate_size=1792, architecture="Qwen3ForCausalLM")
    vocab = build_tokenizer().get_vocab_size()
    return llama_config(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=16, intermediate_size=2816,
                        vocab_size=vocab, max_position_embeddings=4096)


def qwen3_extras(cfg: dict, *, seed: int, std: float = 0.02) -> dict:
    """Qwen3's per-head q/k norm weights, and for the MoE each layer's router and experts
    (the caller drops the dense MLP ``random_llama_weights`` wrote)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    out: dict = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_norm.weight"] = torch.ones(d)
        out[p + "self_attn.k_norm.weight"] = torch.ones(d)
        if "num_experts" in cfg:
            inter = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = torch.randn(cfg["num_experts"], h, generator=gen) * std
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = torch.randn(inter, h, generator=gen) * std
                out[q + "up_proj.weight"] = torch.randn(inter, h, generator=gen) * std
                out[q + "down_proj.weight"] = torch.randn(h, inter, generator=gen) * std
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=("152m", "7m", "1b", "moe-150m", "dense-52m"), default="152m")
    args = parser.parse_args()
    if (args.out_dir / "model.safetensors").is_file():
        print(f"{args.out_dir} exists")
        return
    cfg = config_for(args.size)
    weights = random_llama_weights(cfg, seed=0)
    if cfg["architectures"][0].startswith("Qwen3"):
        if "num_experts" in cfg:  # every layer is sparse: no dense MLP
            weights = {k: v for k, v in weights.items() if ".mlp." not in k}
        weights |= qwen3_extras(cfg, seed=1)
    write_model_dir(args.out_dir, cfg, weights)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
