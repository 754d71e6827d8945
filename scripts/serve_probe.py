#!/usr/bin/env python3
"""Start-up time, idle CPU and load split of a whole ``aserve run`` tree.

    python scripts/serve_probe.py [--tp 2] [--dp 2] [--model DIR] [--requests 64] [--seconds 20]

Starts ``aserve run`` (the embedded default model unless --model), measures the time
from the command's start to the first 200 from ``/ready``, sends ``--requests``
concurrent streamed completions and reports how the engines split them (from
``/metrics``), lets the tree settle for 3 s, then sums user + system CPU time of every
process of the tree from /proc over ``--seconds`` and prints it as a percentage of one
core. JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import anyio
import httpx
from proc_stats import cpu_seconds, process_tree


async def load(base: str, n: int) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Request {i}: hello", "max_tokens": 16, "stream": True, "ignore_eos": True}
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client, \
            anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, client, i)


def main(args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "aserve", "run", *([args.model] if args.model else []), "--tp", str(args.tp),
           "--dp", str(args.dp), "--port", str(args.port), "--log-level", "WARNING", *args.run_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit("aserve run exited while starting")
            time.sleep(0.05)  # a probe's polling period, bounding the measured time's error
        ready_s = time.monotonic() - start
        anyio.run(load, base, args.requests)
        split = {}
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith("aserve:engine_requests_received_total{"):
                split[line.split('"')[1]] = int(float(line.split()[-1]))
        time.sleep(3)
        pids = process_tree(proc.pid)
        before = sum(cpu_seconds(p) for p in pids)
        t0 = time.monotonic()
        time.sleep(args.seconds)
        used = sum(cpu_seconds(p) for p in pids) - before
        idle = 100 * used / (time.monotonic() - t0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    print(f"--tp {args.tp} --dp {args.dp}: ready in {ready_s:.2f} s; {len(pids)} processes; "
          f"{args.requests} requests split {split}; idle {idle:.2f}% of one core over {args.seconds:.0f} s")
    print(json.dumps({"tp": args.tp, "dp": args.dp, "ready_seconds": round(ready_s, 2), "processes": len(pids),
                      "split": split, "idle_cpu_percent_of_one_core": round(idle, 2)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("run_args", nargs="*", help="more flags for aserve run, after --")
    main(parser.parse_args())
