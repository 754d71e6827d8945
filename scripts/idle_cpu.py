#!/usr/bin/env python3
"""CPU used by an idle engine: AsyncLLM at TP = 2 (engine core + 2 workers), 10 s.

    python scripts/idle_cpu.py [--model DIR] [--tp 2] [--seconds 10]

Starts the engine, runs one request so every process has done real work, lets it
settle for 2 s, then sums user + system CPU time of the engine core and its workers
from /proc over the window and prints it as a percentage of one core.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio

from aserve import SamplingParams
from aserve.frontend.async_llm import AsyncLLM
from proc_stats import cpu_seconds, process_tree


async def main(args: argparse.Namespace) -> None:
    async with AsyncLLM(args.model, tensor_parallel_size=args.tp, kv_cache_memory=1 << 28) as llm:
        async for _ in llm.generate("Hello", SamplingParams(max_tokens=8)):
            pass
        await anyio.sleep(2)
        pids = process_tree(llm.engine_core.engine_process.pid)
        before = sum(cpu_seconds(p) for p in pids)
        start = time.monotonic()
        await anyio.sleep(args.seconds)
        used = sum(cpu_seconds(p) for p in pids) - before
        elapsed = time.monotonic() - start
    percent = 100 * used / elapsed
    print(f"{len(pids)} processes idle for {elapsed:.1f} s used {used:.2f} CPU-s: {percent:.2f}% of one core")
    print(json.dumps({"processes": len(pids), "seconds": round(elapsed, 1), "cpu_percent_of_one_core": round(percent, 2)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    anyio.run(main, parser.parse_args())
