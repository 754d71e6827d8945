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
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.server import Server  # noqa: E402


def one_round(model: str, victim: str) -> dict[str, float]:
    server = Server(Path(model), "--tp", "2", "--dp", "2", "--max-model-len", "2048", "--kv-cache-memory", "1GiB",
                    "--log-level", "WARNING")
    base = server.base_url
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
    pid = next(p for p, t in server.title_list() if t == victim)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    while httpx.get(base + "/health", timeout=5).status_code == 200:
        time.sleep(0.05)
    detected = time.monotonic() - stopped
    for r in readers:
        r.join(120)
    server.proc.wait(120)
    server.stop()
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
