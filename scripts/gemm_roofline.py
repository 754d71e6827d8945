#!/usr/bin/env python3
"""GEMM GFLOP/s and copy bandwidth of this machine at the shapes the 152M benchmark runs.

    python scripts/gemm_roofline.py [--threads 2] [--rows 32 4096]

For each shape [M x K] . [K x N] (M = 32 decode rows and 4096 prefill rows, or
``--rows``) it times ``F.linear``, oneDNN on a prepacked weight, and aserve's own kernel
for the dtype where this CPU runs one (``aserve.kernels.f32_linear``; for bf16 the AMX or
AVX512-BF16 kernel), in float32 and bfloat16, and prints GFLOP/s, so engine figures can
be stated as a fraction of them and the kernels set against each other. Each product is
timed on one weight called again and again, so a weight that fits the last-level cache
(the 4 MB ``o_proj`` at 32 rows) reads faster than in a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, K, N) of the 152M Llama's projections (hidden 1024, intermediate 2816).
SHAPES = [("qkv", 1024, 3072), ("o_proj", 1024, 1024), ("gate_up", 1024, 5632), ("down", 2816, 1024)]


def timed(fn, seconds: float = 0.3) -> float:
    fn()
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 4096], help="M, the activations' rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from aserve.kernels import bf16_linear, f32_linear

    results = []
    print(f"{'dtype':<9} {'M':>5} {'shape':<8} {'F.linear GF/s':>14} {'packed GF/s':>12} {'aserve GF/s':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))
        except RuntimeError as exc:  # e.g. bf16 on an AVX2 CPU; aserve then keeps F.linear too
            print(f"{str(dtype)[6:]:<9} oneDNN cannot prepack on this CPU ({exc}): skipped")
            continue
        kernel = f32_linear.load() if dtype == torch.float32 else bf16_linear.load_best()
        for m in args.rows:
            total_flops = total_plain = total_packed = total_own = 0.0
            for name, k, n in SHAPES:
                x = torch.randn(m, k).to(dtype)
                w = torch.randn(n, k).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w)
                flops = 2 * m * k * n
                plain = timed(lambda: F.linear(x, w))
                pk = timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                own = ""
                if kernel is not None:
                    own_packed = kernel.pack(w)
                    own_s = timed(lambda: kernel.linear(x, own_packed, n))
                    total_own += own_s
                    own = f"{flops / own_s / 1e9:.0f}"
                total_flops += flops
                total_plain += plain
                total_packed += pk
                print(f"{str(dtype)[6:]:<9} {m:>5} {name:<8} {flops / plain / 1e9:>14.0f} {flops / pk / 1e9:>12.0f} "
                      f"{own:>12}")
            # One decoder layer's projections, 12 layers: the GEMM floor of one step.
            results.append({"dtype": str(dtype)[6:], "M": m, "layer_gflops_plain": round(total_flops / total_plain / 1e9),
                            "layer_gflops_packed": round(total_flops / total_packed / 1e9),
                            "layer_gflops_aserve": round(total_flops / total_own / 1e9) if total_own else None,
                            "step_gemm_ms_12_layers_packed": round(12 * total_packed * 1e3, 1)})
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() / copy_s / 1e9
    print(f"memory copy: {bandwidth:.1f} GB/s (read + write, 64 MiB)")
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"copy_gb_s": round(bandwidth, 1)}))


if __name__ == "__main__":
    main()
