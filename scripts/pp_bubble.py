#!/usr/bin/env python3
"""The pipeline's bubble: how busy each stage's worker is over a PP = 2 run.

    python scripts/pp_bubble.py [--model bench-models/llama-152m] [--dtype bfloat16]
                                [--prompts 32] [--input-len 128] [--output-len 128]

Runs ``LLM.generate`` of random prompts with ``pipeline_parallel_size=2`` (one torch
thread a worker) and reads each worker's CPU time (``/proc/PID/stat``, user + system)
before and after: with one compute thread and blocking waits (gloo's point-to-point
sleeps), CPU time over the wall time is the share of the run the stage was computing;
the rest is its bubble (waiting for the other stage, or for the engine core). For
comparison it runs the same load with PP = 1 and TP = 1 and TP = 2 (one thread a
worker), and prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, **parallel) -> dict:
    import torch

    from aserve import LLM, SamplingParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    with LLM(args.model, dtype=args.dtype, worker_threads=1, **parallel) as llm:
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        workers = [p.pid for p in getattr(llm.engine.executor, "workers", [])]
        before = [cpu_seconds(pid) for pid in workers]
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        busy = [round((cpu_seconds(pid) - b) / wall, 3) for pid, b in zip(workers, before)]
    return {**parallel, "wall_s": round(wall, 2), "output_tok_s": round(args.prompts * args.output_len / wall, 1),
            "worker_busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "bench-models" / "llama-152m"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    for parallel in (dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2), dict()):
        print(json.dumps(run(args, **parallel)), flush=True)


if __name__ == "__main__":
    main()
