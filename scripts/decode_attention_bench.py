#!/usr/bin/env python3
"""The C decode-attention kernel alone, for each KV cache dtype, out of the CPU's caches.

    python scripts/decode_attention_bench.py [--shape 7m|152m] [--layers 8] [--threads 1 2]
                                             [--tokens 192] [--rounds 3]

Builds ``--layers`` layers of a paged cache (32 sequences of ``--tokens`` tokens, blocks of
16 in a random order, as a served pool holds them), each with its own blocks, so that
cycling through them reads from memory and not from the last-level cache (8 layers of the
7M shape hold 50 MB in float32). Queries are float32; the cache is float32 (``auto`` under
a float32 model) or bfloat16 (``--kv-cache-dtype bfloat16``). Prints microseconds a layer
and the cache bytes read per second, alternating the dtypes ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import time

import torch

from aserve.kernels.cpu_decode_attention import load

SHAPES = {"7m": (4, 2, 64), "152m": (16, 16, 64)}  # query heads, KV heads, head_dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7m")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    attend = load()
    if attend is None:
        raise SystemExit("the decode-attention kernel did not build (see the log)")
    hq, hk, dim = SHAPES[args.shape]
    batch, block_size, length = 32, 16, args.tokens
    per_row = -(-length // block_size)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        cache = torch.randn(2, batch * per_row + 1, block_size, hk, dim, generator=gen)
        table = torch.randperm(batch * per_row, generator=gen).view(batch, per_row) + 1
        layers.append((cache, table))
    q = torch.randn(batch, hq, dim, generator=gen)
    seq_lens = torch.full((batch,), length, dtype=torch.int64)
    caches = {dtype: [(c.to(dtype), t) for c, t in layers] for dtype in (torch.float32, torch.bfloat16)}
    print(f"{args.shape} shape: {batch} sequences x {length} tokens, {hq} query / {hk} KV heads of {dim}, "
          f"{args.layers} layers cycled")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            for dtype, cycled in caches.items():
                for cache, table in cycled:  # warm-up: page in, build
                    attend(q, cache[0], cache[1], table, seq_lens, dim**-0.5)
                reps = 20
                start = time.perf_counter()
                for _ in range(reps):
                    for cache, table in cycled:
                        attend(q, cache[0], cache[1], table, seq_lens, dim**-0.5)
                per_layer = (time.perf_counter() - start) / reps / len(cycled)
                read = 2 * batch * length * hk * dim * dtype.itemsize
                print(f"threads {threads}, cache {str(dtype).removeprefix('torch.'):<8}: {per_layer * 1e6:7.0f} us a "
                      f"layer, {read / per_layer / 1e9:5.1f} GB/s of cache")


if __name__ == "__main__":
    main()
