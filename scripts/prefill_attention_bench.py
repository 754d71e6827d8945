#!/usr/bin/env python3
"""The bf16 prefill-attention kernel alone (AMX, or AVX512-BF16 without it), on one prompt.

    python scripts/prefill_attention_bench.py [--shape 7m|152m] [--tokens 512 2048 8192]
                                              [--threads 2] [--rounds 4] [--against DIR]

Causal attention of one fresh prompt of each ``--tokens`` length, over four layers'
random queries, keys and values (the model's heads: ``--shape``), each layer called four
times a round; prints, per round, the median milliseconds a layer call and the GFLOP/s of
its two products (2 x 2 x D x Hq for each visible query-key pair). ``--against DIR``:
another checkout (a ``git worktree`` of an earlier commit, say) whose kernel is built and
timed in the same rounds, alternating, after checking whether both give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"7m": (4, 2, 64), "152m": (16, 16, 64)}  # query heads, KV heads, head_dim


def kernel_from(tree: Path) -> Callable:
    """The bf16 prefill-attention kernel of the checkout at ``tree``, imported apart from
    the ``aserve`` already loaded (the modules of each stay bound to their own tree)."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "aserve" or name.startswith("aserve.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        from aserve.kernels import cpu_prefill_attention

        if not Path(cpu_prefill_attention.__file__).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{tree} has no aserve package of its own")
        attend = cpu_prefill_attention.load(torch.bfloat16)
    finally:
        sys.path.remove(str(tree))
        for name in [n for n in sys.modules if n == "aserve" or n.startswith("aserve.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    if attend is None:
        raise SystemExit(f"no bf16 prefill-attention kernel from {tree} on this CPU (it needs AMX or AVX512-BF16)")
    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="152m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--against", type=Path, help="another checkout to alternate with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"this": kernel_from(ROOT)}
    if args.against is not None:
        kernels["against"] = kernel_from(args.against)
    hq, hk, dim = SHAPES[args.shape]
    scale = dim**-0.5
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        layers = [tuple(torch.randn(tokens, h, dim, generator=gen).to(torch.bfloat16) for h in (hq, hk, hk))
                  for _ in range(4)]
        outs = {name: [torch.empty(tokens, hq, dim, dtype=torch.bfloat16) for _ in layers] for name in kernels}
        for name, attend in kernels.items():  # build, page in, and the outputs to compare
            for (q, k, v), out in zip(layers, outs[name]):
                attend(q, k, v, out, [0], [tokens], scale)
        flops = 4 * dim * hq * tokens * (tokens + 1) / 2
        line = f"{args.shape} shape, {tokens} tokens, {args.threads} threads"
        if "against" in kernels:
            same = all(torch.equal(a, b) for a, b in zip(outs["this"], outs["against"]))
            line += f"; the same bits as --against: {'yes' if same else 'no'}"
        print(line, flush=True)
        for r in range(args.rounds):
            for name, attend in kernels.items():
                times = []
                for _ in range(4):
                    for (q, k, v), out in zip(layers, outs[name]):
                        start = time.perf_counter()
                        attend(q, k, v, out, [0], [tokens], scale)
                        times.append(time.perf_counter() - start)
                ms = statistics.median(times) * 1e3
                print(f"  round {r + 1} {name:<8} {ms:9.3f} ms a layer  {flops / ms / 1e6:7.0f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
