#!/usr/bin/env python3
"""How long a stopped process goes unnoticed: SIGSTOP one process of a serving
``aserve run --tp 2 --dp 2`` (default flags) with streams in flight, then time ``/health``
turning 503, the last stream ending, and the supervisor exiting.

    python scripts/fault_times.py MODEL_DIR [--rounds 3] [--victims aserve::worker_tp1 aserve::engine_core_0]

Prints one line per round and a summary per victim; ``docs/performance.md`` has the
figures. Polls ``/health`` every 50 ms, so times are good to about 0.05 s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def tree(pid: int) -> list[int]:
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return [k for c in kids for k in (c, *tree(c))]


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except FileNotFoundError:
        return ""


def one_round(model: str, victim: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "aserve", "run", model, "--tp", "2", "--dp", "2", "--port", "0",
           "--max-model-len", "2048", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = ""
    while not base:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("aserve run exited")
        if m := re.search(r"at (https?://\S+)/v1", line):
            base = m.group(1)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    while True:
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    ended: list[float] = []
    streaming = threading.Barrier(5)

    def stream(rank: int) -> None:
        body = {"prompt": "Hello", "max_tokens": 1500, "stream": True, "ignore_eos": True, "min_tokens": 1500}
        first = True
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120,
                              headers={"X-data-parallel-rank": str(rank)}) as r:
                for _ in r.iter_lines():
                    if first:
                        first = False
                        streaming.wait()
        except httpx.HTTPError:
            pass
        finally:
            if first:
                streaming.abort()
            ended.append(time.monotonic())

    readers = [threading.Thread(target=stream, args=(i % 2,)) for i in range(4)]
    for r in readers:
        r.start()
    streaming.wait()
    pid = next(p for p in tree(proc.pid) if title(p) == victim)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    while httpx.get(base + "/health", timeout=5).status_code == 200:
        time.sleep(0.05)
    detected = time.monotonic() - stopped
    for r in readers:
        r.join(120)
    proc.wait(120)
    return {"health_503_s": detected, "streams_ended_s": max(ended) - stopped, "tree_exited_s": time.monotonic() - stopped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--victims", nargs="+", default=["aserve::worker_tp1", "aserve::engine_core_0"])
    args = parser.parse_args()
    for victim in args.victims:
        rows = []
        for i in range(args.rounds):
            row = one_round(args.model, victim)
            rows.append(row)
            print(victim, i + 1, " ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
        print(victim, "median", " ".join(f"{k}={statistics.median(r[k] for r in rows):.2f}" for k in rows[0]),
              flush=True)


if __name__ == "__main__":
    main()
