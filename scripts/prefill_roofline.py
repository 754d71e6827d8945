#!/usr/bin/env python3
"""A long prompt's prefill against the GEMM rate at its shape, on this machine, now.

    python scripts/prefill_roofline.py [--model bench-models/llama-152m] [--dtype bfloat16]
                                       [--prompt-len 2048] [--prompts 6] [--repeats 3]

A prefill step of ``prompt-len`` tokens is mostly the model's projections at
``prompt-len`` rows; its attention, norms, rotary and the KV write come on top. The
bound it is measured against is those projections alone at the machine's GEMM rate: for
each of a layer's four products (qkv, o, gate/up, down, shapes from ``config.json``),
the faster of oneDNN on a prepacked weight and aserve's own kernel for the dtype (as
``scripts/gemm_roofline.py`` times them), best of five calls, over ``prompt-len`` rows,
times the layers. The ratio printed is that time over the prefill step's, which is the
prefill's tokens/s over the GEMM rate's (the target: at least 0.75).

Each repeat takes the GEMM time right before the prefill figures (the machine is a VM
whose rate moves within the hour), then runs ``prompts`` different random prompts one
at a time through ``LLM.generate`` (one output token each, prefix caching off, a token
budget that holds the prompt: one step each) and takes the median ``execute_model`` of
the prefill steps after the first. One JSON line per repeat.
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


def sig(x: float) -> float:
    """``x`` to 4 significant figures."""
    return float(f"{x:.4g}")


def projection_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, K, N) of one decoder layer's products, as the model runs them (q, k, v in
    one; gate and up in one)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    hq = config["num_attention_heads"]
    hk = config.get("num_key_value_heads", hq)
    d = config.get("head_dim", h // hq)
    return [("qkv", h, (hq + 2 * hk) * d), ("o_proj", hq * d, h), ("gate_up", h, 2 * inter), ("down", inter, h)]


def gemm_seconds(shapes: list[tuple[str, int, int]], rows: int, dtype: str) -> dict[str, float]:
    """Seconds of each product at ``rows`` rows: the faster of oneDNN prepacked and
    aserve's kernel, the best of five calls of each."""
    import torch

    from aserve.kernels import bf16_linear, f32_linear

    dt = getattr(torch, dtype)
    kernel = bf16_linear.load_best() if dt == torch.bfloat16 else f32_linear.load() if dt == torch.float32 else None
    out = {}
    for name, k, n in shapes:
        x = torch.randn(rows, k).to(dt)
        w = (torch.randn(n, k) * 0.05).to(dt)
        runs = []
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            runs.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        except RuntimeError:
            pass  # oneDNN cannot pack this dtype on this CPU
        if kernel is not None:
            own = kernel.pack(w)
            runs.append(lambda: kernel.linear(x, own, n))
        if not runs:
            runs.append(lambda: torch.nn.functional.linear(x, w))
        out[name] = best_seconds(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "bench-models" / "llama-152m"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=6, help="prefills a repeat (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.prompts < 2:
        parser.error("--prompts must be at least 2 (the first prefill of a repeat is not counted)")

    import torch

    from aserve import LLM, SamplingParams
    from aserve.worker import model_runner

    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = projection_shapes(config)
    layers = config["num_hidden_layers"]
    steps: list[float] = []
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    budget = max(args.prompt_len, 2048)
    with timed_calls(model_runner.ModelRunner, "execute_model", steps), \
            LLM(model=args.model, dtype=args.dtype, seed=0, enable_prefix_caching=False,
                max_num_batched_tokens=budget, max_model_len=args.prompt_len + 16) as llm:
        threads = torch.get_num_threads()
        for _ in range(args.repeats):
            per_product = gemm_seconds(shapes, args.prompt_len, args.dtype)
            gemm = layers * sum(per_product.values())
            steps.clear()
            for _ in range(args.prompts):
                prompt = torch.randint(0, config["vocab_size"], (args.prompt_len,), generator=gen).tolist()
                llm.generate([prompt], params)
            prefill = statistics.median(steps[1:])
            flops = 2 * args.prompt_len * sum(k * n for _, k, n in shapes) * layers
            print(json.dumps({
                "prompt_len": args.prompt_len, "threads": threads,
                "gemm_ms": sig(gemm * 1e3), "gemm_gflops": round(flops / gemm / 1e9),
                "gemm_ms_by_product": {k: sig(v * layers * 1e3) for k, v in per_product.items()},
                "prefill_ms": sig(prefill * 1e3),
                "prefill_tok_s": round(args.prompt_len / prefill), "gemm_tok_s": round(args.prompt_len / gemm),
                "prefill_over_gemm_rate": round(gemm / prefill, 3),
            }), flush=True)


if __name__ == "__main__":
    main()
