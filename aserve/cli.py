"""The ``aserve`` command.

    aserve generate "PROMPT" [--model PATH] [--max-tokens N] [--temperature T]

prints the completion of PROMPT. With no ``--model`` it uses the embedded default
model, built on first use into ``$ASERVE_CACHE_DIR`` (random weights: its text is
nonsense, which stderr says).
"""

from __future__ import annotations

import argparse
import sys

from aserve.config import DTYPES
from aserve.errors import AserveError


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face-format model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weight and activation dtype (default: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest sequence (prompt + output) to serve")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 4 GiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aserve", description="LLM inference with the OpenAI API's shapes.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt", help="the text to complete")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from aserve import LLM, SamplingParams
    from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY

    if args.model is None:
        print("aserve: using the embedded default model (random weights: its output is nonsense)", file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed,
    )
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY,
    )
    output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except AserveError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
