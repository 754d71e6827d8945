#!/usr/bin/env python3
"""The float32 linear kernel (or the float32 one-call decode step) of a git revision
against the working tree's, alternating in one process, so that a VM's drift between
runs does not decide the comparison.

    python scripts/f32_kernel_ab.py --before HEAD~1 [--shapes 152m|7m] [--rows 1 8 32 2048]
                                    [--threads 2] [--weights 6] [--rounds 3]
    python scripts/f32_kernel_ab.py --before HEAD~1 --decode-step bench-models/llama-152m
                                    [--batch 32] [--output-len 65] [--rounds 6]

Both libraries are built (``aserve.kernels.cbuild``, as aserve builds them) from
``aserve/kernels`` of the revision and of the working tree. The first form times
``aserve_f32_linear`` over ``--weights`` packed weights of each shape, cycled so that
they are read from memory, and prints GFLOP/s a round for each. The second runs
``LLM.generate`` (greedy, ``--batch`` random prompts of 128 tokens) with the model's
one-call decode stack switched between the two libraries call by call, checks that they
give the same tokens, and prints the median stack time of each call.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (out features, in features)
    "152m": {"qkv": (3072, 1024), "o_proj": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)},
    "7m": {"qkv": (512, 256), "o_proj": (256, 256), "gate_up": (1408, 256), "down": (256, 704)},
}


def build_both(revision: str, source: str) -> dict[str, Path]:
    """{"before": library, "after": library} built from ``aserve/kernels/<source>``."""
    from aserve.envs import read_env
    from aserve.kernels.cbuild import build

    cache = read_env().cache_dir / "kernels"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "aserve/kernels"], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix="f32_kernel_ab_") as old:  # the library goes to the cache
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        before = build(Path(old) / "aserve" / "kernels" / source, cache, f"{source} at {revision}")
    libs = {"before": before,
            "after": build(ROOT / "aserve" / "kernels" / source, cache, f"{source} in the working tree")}
    if None in libs.values():
        raise SystemExit("a library did not build (see the log)")
    return libs


def linear_rounds(libs: dict[str, Path], args: argparse.Namespace) -> None:
    import torch

    from aserve.kernels.f32_linear import F32Linear

    torch.set_num_threads(args.threads)
    kernels = {name: F32Linear(ctypes.CDLL(str(path))) for name, path in libs.items()}
    for shape, (n, k) in SHAPES[args.shapes].items():
        weights = [kernels["after"].pack(torch.randn(n, k)) for _ in range(args.weights)]  # one layout for both
        for rows in args.rows:
            x = torch.randn(rows, k)
            reps = max(1, 512 // rows)
            rates: dict[str, list[float]] = {name: [] for name in kernels}
            for rnd in range(args.rounds):
                for name in kernels if rnd % 2 == 0 else reversed(kernels):
                    kernel = kernels[name]
                    start = time.perf_counter()
                    for _ in range(reps):
                        for w in weights:
                            kernel.linear(x, w, n)
                    per_call = (time.perf_counter() - start) / reps / len(weights)
                    rates[name].append(2 * rows * n * k / per_call / 1e9)
            print(f"{shape:8} {rows:5} rows  " + "  ".join(
                f"{name} {' '.join(f'{r:5.1f}' for r in rs)}" for name, rs in rates.items()) + "  GFLOP/s", flush=True)


def decode_rounds(libs: dict[str, Path], args: argparse.Namespace) -> None:
    import torch

    from aserve import LLM, SamplingParams
    from aserve.kernels import llama_decode

    fns = {name: llama_decode.LlamaDecodeKernel(ctypes.CDLL(str(path)), torch.float32)._fn
           for name, path in libs.items()}
    current, times = ["after"], []
    inner = llama_decode.DecodeStack.run

    def run(self, *a, **kw):  # the same layers and scratch, the chosen library's entry point
        self._fn = fns[current[0]]
        start = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            times.append(time.perf_counter() - start)

    llama_decode.DecodeStack.run = run
    with LLM(model=args.decode_step, dtype="float32", seed=0) as llm:
        gen = torch.Generator().manual_seed(0)
        vocab = min(400, json.loads((Path(args.decode_step) / "config.json").read_text())["vocab_size"])
        prompts = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(args.batch)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
        llm.generate(prompts, params)  # warm-up
        if not times:
            raise SystemExit("the model's decode steps do not run the one-call stack here")
        first = None
        steps: dict[str, list[float]] = {name: [] for name in fns}
        for rnd in range(args.rounds):
            for name in fns if rnd % 2 == 0 else reversed(fns):
                current[0] = name
                times.clear()
                tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                first = first or tokens
                if tokens != first:
                    raise SystemExit(f"{name}: other tokens than the first call's")
                steps[name].append(statistics.median(times) * 1e3)
        for name, ms in steps.items():
            print(f"{name}: median stack {' '.join(f'{m:.1f}' for m in ms)} ms, mean {statistics.mean(ms):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="152m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (kernel) or 6 (decode step)")
    parser.add_argument("--decode-step", metavar="MODEL", help="compare the one-call decode step on this model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=65)
    args = parser.parse_args()
    if args.decode_step:
        args.rounds = args.rounds or 6
        decode_rounds(build_both(args.before, "cpu_llama_decode_f32.c"), args)
    else:
        args.rounds = args.rounds or 3
        linear_rounds(build_both(args.before, "cpu_f32_linear.c"), args)


if __name__ == "__main__":
    main()
