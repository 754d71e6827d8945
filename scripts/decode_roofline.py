#!/usr/bin/env python3
"""The decode step against its floor (memory, or the linear layers' arithmetic), on this machine, now.

    python scripts/decode_roofline.py [--model bench-models/llama-152m] [--dtype bfloat16]
                                      [--kv-cache-dtype auto|float32|bfloat16] [--block-size 16]
                                      [--repeats 3]

A decode step at batch 32 reads every weight once and every sequence's keys and
values once; at these sizes that traffic, not arithmetic, bounds it. For each repeat
this measures the plain read rate of the cores (two threads summing 512 MiB on 2 MiB
pages: ``scripts/read_bandwidth.c``), then runs ``LLM.generate`` of ``batch`` random
prompts of ``prompt-len`` tokens and ``output-len`` new ones in process and takes the
median decode step (``ModelRunner.execute_model``) and the median one-call layer
stack inside it (``DecodeStack.run``, bf16 only). The floor is the bytes a decode
step reads at that rate: the weights (from ``config.json``) and the KV cache at the
run's mean context, in the KV cache's dtype (but see below). Prints one JSON line per repeat. The machine is a VM: take the
read rate right before each step figure, as this does, and repeat.

Where the arithmetic of the linear layers at this batch takes longer than reading their
weights (an AVX512-BF16 CPU without AMX at batch 32: ~9.9 GFLOP at ~430 GFLOP/s is
longer than 309 MB at ~33 GB/s), that bounds them instead: the floor is the larger of
the weights' read time and their products at the machine's measured GEMM rate
(:func:`gemm_rate`), plus the KV cache's read time. ``memory_floor_ms`` is the bytes
alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from step_timing import best_seconds, timed_calls  # noqa: E402

_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_bytes(config: dict, dtype: str, kv_tokens: float, kv_dtype: str | None = None) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step reads: every projection and the LM head
    (the embedding gives only the batch's rows), and each sequence's keys and values
    (stored in ``kv_dtype``, default ``dtype``)."""
    size = _SIZES[dtype]
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    hq = config["num_attention_heads"]
    hk = config.get("num_key_value_heads", hq)
    d = config.get("head_dim", h // hq)
    per_layer = h * (hq + 2 * hk) * d + hq * d * h + 3 * h * inter + 2 * h
    weights = (layers * per_layer + config["vocab_size"] * h + h) * size
    kv = kv_tokens * layers * 2 * hk * d * _SIZES[kv_dtype or dtype]
    return weights, kv


def read_rate(threads: int) -> float:
    import ctypes

    from aserve.envs import read_env
    from aserve.kernels.cbuild import load_library

    # Built and cached where aserve's kernels are (ASERVE_CACHE_DIR/kernels).
    lib = load_library(ROOT / "scripts" / "read_bandwidth.c", read_env().cache_dir / "kernels",
                       "the read-bandwidth probe")
    if lib is None:
        raise SystemExit("needs a C compiler (gcc) for scripts/read_bandwidth.c")
    lib.read_gbps.restype = ctypes.c_double
    lib.read_gbps.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib.read_gbps(512 << 20, threads, 1, 3)


def gemm_rate(dtype: str, threads: int) -> float:
    """GFLOP/s of this machine's fastest dense product in ``dtype`` at a size where
    arithmetic, not memory, bounds it: 2,048 rows through the 152M model's gate/up
    weight ([5,632 x 1,024]), on oneDNN's prepacked form (where oneDNN can pack this
    dtype here) and on aserve's own bf16 or float32 kernel where this CPU has one, else
    on a plain product (at 256 rows: its rate is as flat past a few hundred rows, and a
    bf16 product on an AVX2 CPU takes seconds at 2,048); the best of the runs of each."""
    import torch

    from aserve.kernels import bf16_linear, f32_linear

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    x = torch.randn(2048, 1024).to(dt)
    w = (torch.randn(5632, 1024) * 0.05).to(dt)
    candidates = []
    if dt in (torch.float32, torch.bfloat16):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        except RuntimeError:
            pass  # oneDNN packs bf16 only with AVX-512 (bw/vl/dq) or avx_ne_convert: not on an AVX2-only CPU
    kernel = bf16_linear.load_best() if dt == torch.bfloat16 else f32_linear.load() if dt == torch.float32 else None
    if kernel is not None:
        kpacked = kernel.pack(w)
        candidates.append(lambda: kernel.linear(x, kpacked, 5632))
    rows = 2048
    if not candidates:
        rows = 256
        candidates.append(lambda: x[:rows] @ w.t())
    return 2 * rows * 5632 * 1024 / best_seconds(candidates) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "bench-models" / "llama-152m"))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_SIZES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(_SIZES)])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    args = parser.parse_args()

    from aserve import LLM
    from aserve.kernels import llama_decode
    from aserve.worker import model_runner

    times: dict[str, list[float]] = {"execute": [], "stack": []}
    with timed_calls(model_runner.ModelRunner, "execute_model", times["execute"]), \
            timed_calls(llama_decode.DecodeStack, "run", times["stack"]), \
            LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                seed=0) as llm:
        measure(llm, args, times)


def measure(llm, args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    import torch

    from aserve import SamplingParams

    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts, params)  # warm-up: kernels built, pages touched
    # Decode step i attends over prompt_len + i tokens (i = 1 .. output_len - 1).
    kv_tokens = args.batch * (args.prompt_len + args.output_len / 2)
    kv_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    weights, kv = step_bytes(config, args.dtype, kv_tokens, kv_dtype)
    threads = torch.get_num_threads()
    flops_rate = 0.0
    for _ in range(args.repeats):
        rate = read_rate(threads)
        # The rate is the hardware's: a slower run only means another process had a core.
        flops_rate = max(flops_rate, gemm_rate(args.dtype, threads))
        for v in times.values():
            v.clear()
        llm.generate(prompts, params)
        step = statistics.median(times["execute"][1:])  # the first call is the prefill
        stack = statistics.median(times["stack"]) if times["stack"] else None
        memory_floor = (weights + kv) / (rate * 1e9)
        # The linear layers cannot beat their arithmetic at the machine's GEMM rate either.
        compute = 2 * args.batch * weights / _SIZES[args.dtype] / (flops_rate * 1e9)
        floor = max(weights / (rate * 1e9), compute) + kv / (rate * 1e9)
        print(json.dumps({
            "read_gb_s": round(rate, 1), "gemm_gflops": float(f"{flops_rate:.4g}"), "threads": threads,
            "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "weight_bytes": int(weights), "kv_bytes": int(kv), "memory_floor_ms": round(memory_floor * 1e3, 4),
            "linear_compute_ms": round(compute * 1e3, 6),
            "floor_ms": round(floor * 1e3, 6), "decode_step_ms": round(step * 1e3, 3),
            "step_over_floor": round(step / floor, 2),
            "layer_stack_ms": None if stack is None else round(stack * 1e3, 3),
            "stack_over_floor": None if stack is None else round(stack / floor, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
