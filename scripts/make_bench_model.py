#!/usr/bin/env python3
"""Writes the benchmark Llama models (random weights, fixed seed) in Hugging Face format.

    python scripts/make_bench_model.py OUT_DIR [--size 152m|7m]

152m: hidden 1024, 12 layers, 16 heads, intermediate 2816 (~155M parameters with
aserve's tiny tokenizer). 7m: hidden 256, 4 layers (the embedded default's shape).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aserve.model_builder import default_model_config, llama_config, random_llama_weights, write_model_dir
from aserve.tiny_tokenizer import build_tokenizer


def config_for(size: str) -> dict:
    if size == "7m":
        return default_model_config()
    vocab = build_tokenizer().get_vocab_size()
    return llama_config(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=16, intermediate_size=2816,
                        vocab_size=vocab, max_position_embeddings=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=("152m", "7m"), default="152m")
    args = parser.parse_args()
    if (args.out_dir / "model.safetensors").is_file():
        print(f"{args.out_dir} exists")
        return
    cfg = config_for(args.size)
    write_model_dir(args.out_dir, cfg, random_llama_weights(cfg, seed=0))
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
