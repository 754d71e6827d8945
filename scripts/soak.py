#!/usr/bin/env python3
"""Soak a server: thousands of requests with random aborts and disconnects, while the RSS
and open file descriptors of every process of the tree are sampled; both must stay flat.

    python scripts/soak.py [--requests 20000] [--model DIR] [--server-args "--tp 2 --dp 2"] [--out soak.json]

Starts ``aserve run`` (the benchmark's 7M model by default, built if missing), sends
``--requests`` requests ``--concurrency`` at a time: streamed completions that the client
drops after a random number of chunks, whole completions whose client gives up after a
random short timeout, chat requests, and ones that finish normally. Every
``--sample-every`` seconds it records each process's RSS (MiB) and open fds. At the end
it compares the samples of the last quarter of the run with those of the second quarter
(after warm-up): "flat" means each process's RSS grew by less than ``--rss-slack`` MiB
and its fd count by at most ``--fd-slack``. Exits 1 if not flat, or if the server stopped
serving. The JSON (``--out``) holds every sample.

A worker's RSS rises until every block of its KV pool has been handed out once: the pool
is an anonymous mapping whose pages are committed on their first write. The run must be
long enough for that to happen before its second quarter: 3,000 requests at ``--tp 2
--dp 2`` were not on a slow host, the default 20,000 were (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.e2e.server import Server, process_tree  # noqa: E402


def sample(root: int) -> dict[str, dict[str, float]]:
    """Title (with the pid, for duplicates) -> RSS MiB and open fds, for the whole tree."""
    out = {}
    for pid in [root, *process_tree(root)]:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        out[f"{title}[{pid}]"] = {"rss_mib": rss_kb / 1024, "fds": fds}
    return out


async def one_request(client: httpx.AsyncClient, base: str, rng: random.Random, tally: dict[str, int]) -> None:
    kind = rng.choice(["stream_drop", "stream_full", "whole", "whole_timeout", "chat_stream_drop", "chat"])
    max_tokens = rng.randint(1, 64)
    chat = kind.startswith("chat")
    body: dict = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Question {rng.randint(0, 10**6)}"}]
    else:
        body["prompt"] = f"Prompt {rng.randint(0, 10**6)} " * rng.randint(1, 20)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if kind in ("stream_drop", "stream_full", "chat_stream_drop"):
            body["stream"] = True
            drop_after = rng.randint(1, max(1, max_tokens // 2)) if kind != "stream_full" else None
            async with client.stream("POST", base + path, json=body, timeout=60) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if drop_after is not None and chunks >= drop_after:
                            tally["dropped"] += 1
                            return  # leaving the block closes the connection mid-stream
            tally["finished"] += 1
        elif kind == "whole_timeout":
            try:
                await client.post(base + path, json=body, timeout=rng.uniform(0.001, 0.05))
                tally["finished"] += 1
            except httpx.TimeoutException:
                tally["gave_up"] += 1
        else:
            r = await client.post(base + path, json=body, timeout=60)
            tally["finished" if r.status_code == 200 else f"status_{r.status_code}"] += 1
    except httpx.HTTPError as exc:
        tally[f"error_{type(exc).__name__}"] += 1


async def load(base: str, requests: int, concurrency: int, seed: int, tally: dict[str, int]) -> None:
    rng = random.Random(seed)
    limiter = anyio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(limits=limits) as client, anyio.create_task_group() as tg:
        for _ in range(requests):
            await limiter.acquire()

            async def run(r: random.Random = random.Random(rng.random())) -> None:
                try:
                    await one_request(client, base, r, tally)
                finally:
                    limiter.release()

            tg.start_soon(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--model", default=str(ROOT / "bench-models" / "llama-7m"))
    parser.add_argument("--server-args", default="")
    parser.add_argument("--sample-every", type=float, default=2.0)
    parser.add_argument("--rss-slack", type=float, default=16.0, help="MiB of RSS growth allowed per process")
    parser.add_argument("--fd-slack", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_bench_model.py"), str(model), "--size", "7m"],
                       check=True, stdout=subprocess.DEVNULL)
    server = Server(model, "--kv-cache-memory", "1GiB", "--max-model-len", "2048", "--log-level", "WARNING",
                    *shlex.split(args.server_args))
    base = server.base_url
    samples: list[dict] = []
    done = threading.Event()
    start = time.monotonic()

    def sampler() -> None:
        while not done.is_set():
            samples.append({"t": round(time.monotonic() - start, 2), "procs": sample(server.proc.pid)})
            done.wait(args.sample_every)

    tally: dict[str, int] = {}

    class Tally(dict):
        def __missing__(self, key: str) -> int:
            return 0

    tally = Tally()
    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        anyio.run(load, base, args.requests, args.concurrency, args.seed, tally)
        serving = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        ok = serving.status_code == 200 and httpx.get(base + "/health", timeout=5).status_code == 200
    finally:
        done.set()
        thread.join()
        server.stop()
    duration = time.monotonic() - start
    quarter = max(1, len(samples) // 4)
    warm, last = samples[quarter: 2 * quarter], samples[-quarter:]
    flat = True
    print(f"{args.requests} requests in {duration:.0f} s: {dict(tally)}")
    for name in samples[-1]["procs"]:
        def med(rows: list[dict], key: str) -> float:
            values = [r["procs"][name][key] for r in rows if name in r["procs"]]
            return statistics.median(values) if values else float("nan")

        rss = (med(warm, "rss_mib"), med(last, "rss_mib"))
        fds = (med(warm, "fds"), med(last, "fds"))
        grew = rss[1] - rss[0] > args.rss_slack or fds[1] - fds[0] > args.fd_slack
        flat &= not grew
        print(f"{name:40} RSS {rss[0]:7.1f} -> {rss[1]:7.1f} MiB   fds {fds[0]:4.0f} -> {fds[1]:4.0f}"
              f"{'   GREW' if grew else ''}")
    print(f"flat: {flat}; serving after the soak: {ok}")
    if args.out:
        Path(args.out).write_text(json.dumps({"requests": args.requests, "duration_s": duration, "tally": tally,
                                              "samples": samples, "flat": flat, "serving": ok}))
    sys.exit(0 if flat and ok else 1)


if __name__ == "__main__":
    main()
