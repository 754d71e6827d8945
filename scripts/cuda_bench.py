#!/usr/bin/env python3
"""The CUDA path's speed against the HBM floor, for ``scripts/cuda_check.sh`` on a lent GPU.

    python scripts/cuda_bench.py [--models 152m,1b] [--device cuda] [--batches 1,32]
                                 [--serve] [--model-dir DIR] [--out DIR]

For each model (the 152M benchmark Llama, and a ~1B-parameter Llama made here by
``scripts/make_bench_model.py --size 1b``), in bf16:

- the decode step at each batch size, with CUDA graphs and with ``enforce_eager``: the
  median ``ModelRunner.execute_model`` of the decode steps of ``LLM.generate`` (prompts
  of 128 random tokens, 128 new ones), which includes building the step's inputs,
  sampling and the tokens' transfer to the host;
- the floor: the bytes a decode step reads (every weight once, every sequence's keys
  and values at the run's mean context; ``decode_roofline.step_bytes``) over the copy
  bandwidth measured here (a 1 GiB device-to-device copy: bytes read plus written over
  the time), and the step over it;
- whether the graphs' tokens equal the eager ones (greedy, the batch's first run);
- with ``--serve`` (the 152M model only): ``aserve run`` and ``aserve bench serve`` at
  32 streams, 128 in / 128 out, output tokens/s;
- with ``--profile`` (the first model, the largest batch, graphs): a ``torch.profiler``
  trace of 32 decode steps, one ``PROFILE`` line per kernel or op among the costliest
  (device time on a GPU, CPU time on the CPU) and a ``CHECK`` line with the device's
  time a step against the whole step: what of the step is the GPU's and what the host's.

Prints one ``CHECK`` line per figure and writes them all to ``OUT/cuda_bench.json``.
``--device cpu --model-dir DIR`` runs the same steps on a small model on the CPU (no
graphs there): the suite's check that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from decode_roofline import step_bytes  # noqa: E402
from step_timing import timed_calls  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 128


def six_figures(x: float) -> float:
    """``x`` to six significant figures: a time of a few microseconds keeps its precision,
    so a ratio recomputed from the JSON agrees with the one printed."""
    return float(f"{x:.6g}")


def check(results: list[dict], name: str, **figures) -> None:
    results.append({"check": name, **figures})
    print("CHECK", name + ":", ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)


def copy_bandwidth(device: str) -> float:
    """GB/s of a 1 GiB copy on ``device`` (bytes read plus bytes written, over the time)."""
    import torch

    n = (1 << 30) // 4 if device == "cuda" else (64 << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / min(times) / 1e9


def random_prompts(model_dir: Path, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``PROMPT_LEN`` random token ids of the model's vocabulary."""
    import torch

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]


def open_llm(model_dir: Path, *, device: str, dtype: str, batch: int, eager: bool = False):
    """The offline engine every measurement here runs: room for ``batch`` rows of
    ``PROMPT_LEN + OUTPUT_LEN`` tokens, 4 GiB of KV pool on a GPU (256 MiB on the CPU)."""
    from aserve import LLM

    return LLM(str(model_dir), device=device, dtype=dtype, enforce_eager=eager, max_num_seqs=max(batch, 8),
               max_model_len=PROMPT_LEN + OUTPUT_LEN + 16, kv_cache_memory=(4 << 30) if device == "cuda" else (1 << 28))


def decode_steps(model_dir: Path, *, device: str, dtype: str, batch: int, eager: bool) -> tuple[float, list]:
    """(median decode step in seconds, the first run's tokens) of ``batch`` prompts."""
    from aserve import SamplingParams
    from aserve.worker import model_runner

    steps: list[float] = []
    prompts = random_prompts(model_dir, batch, seed=0)
    params = dict(max_tokens=OUTPUT_LEN + 1, ignore_eos=True, temperature=0)
    with timed_calls(model_runner.ModelRunner, "execute_model", steps), \
            open_llm(model_dir, device=device, dtype=dtype, batch=batch, eager=eager) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**params))]
        steps.clear()
        llm.generate(prompts, SamplingParams(**params))
    return statistics.median(steps[1:]), first  # the first step is the prefill (the budget holds it)


PROFILED_STEPS = 32


def profile_steps(model_dir: Path, *, device: str, dtype: str, batch: int, top: int = 12) -> tuple[float, list, list]:
    """(device or CPU seconds a decode step, the ``top`` costliest entries as (name,
    seconds, calls), and on a GPU the ``top`` costliest on the host by their own CPU
    time, else []) over ``PROFILED_STEPS`` decode steps of ``batch`` prompts, graphs on."""
    from torch.profiler import ProfilerActivity, profile

    from aserve import SamplingParams

    prompts = random_prompts(model_dir, batch, seed=1)
    params = SamplingParams(max_tokens=PROFILED_STEPS + 1, ignore_eos=True, temperature=0)
    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with open_llm(model_dir, device=device, dtype=dtype, batch=batch) as llm:
        llm.generate(prompts, params)  # warm: graphs captured, kernels compiled
        with profile(activities=activities) as prof:
            llm.generate(prompts, params)

    def cost(event) -> float:  # microseconds; the attribute's name changed across torch releases
        if on_gpu:
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        return event.self_cpu_time_total

    averages = prof.key_averages()
    events = sorted(averages, key=cost, reverse=True)
    total = sum(cost(e) for e in events) * 1e-6
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top] if on_gpu else []
    return (total / PROFILED_STEPS, [(e.key, cost(e) * 1e-6, e.count) for e in events[:top]],
            [(e.key, e.self_cpu_time_total * 1e-6, e.count) for e in host])


def serve(model_dir: Path, device: str, out: Path) -> float:
    """Output tokens/s of ``aserve bench serve`` at 32 streams against ``aserve run``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "aserve", "run", str(model_dir), "--device", device,
                               "--dtype", "bfloat16", "--port", str(port)], start_new_session=True,
                              stdout=open(out / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready (see {out / 'serve.log'})")
            time.sleep(0.5)
        result = out / "serve.json"
        subprocess.run([sys.executable, "-m", "aserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--model", str(model_dir), "--num-prompts", "256", "--max-concurrency", "32",
                        "--random-input-len", str(PROMPT_LEN), "--random-output-len", str(OUTPUT_LEN),
                        "--ignore-eos", "--no-progress", "--result-filename", str(result)], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(result.read_text())["output_throughput"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="152m,1b")
    parser.add_argument("--model-dir", type=Path, help="one model directory instead of --models")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/aserve-cuda-check")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    rate = copy_bandwidth(args.device)
    check(results, "copy bandwidth", gb_s=round(rate, 1))
    if args.model_dir:
        models = {args.model_dir.name: args.model_dir}
    else:
        models = {}
        for size in args.models.split(","):
            path = Path(f"/tmp/aserve-bench-{size}")
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_bench_model.py"), str(path), "--size", size],
                           check=True, stdout=subprocess.DEVNULL)
            models[size] = path
    for name, path in models.items():
        config = json.loads((path / "config.json").read_text())
        for batch in map(int, args.batches.split(",")):
            weights, kv = step_bytes(config, args.dtype, batch * (PROMPT_LEN + OUTPUT_LEN / 2))
            floor = (weights + kv) / (rate * 1e9)
            graph_step, graph_tokens = decode_steps(path, device=args.device, dtype=args.dtype, batch=batch,
                                                    eager=False)
            eager_step, eager_tokens = decode_steps(path, device=args.device, dtype=args.dtype, batch=batch,
                                                    eager=True)
            check(results, f"{name} decode step, batch {batch}", graphs_ms=six_figures(graph_step * 1e3),
                  eager_ms=six_figures(eager_step * 1e3), floor_ms=six_figures(floor * 1e3),
                  graphs_over_floor=round(graph_step / floor, 2), weight_mb=round(weights / 1e6),
                  kv_mb=round(kv / 1e6))
            same = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
            check(results, f"{name} graphs' tokens, batch {batch}", equal_to_eager=f"{same}/{len(graph_tokens)}")
    if args.profile:
        name, path = next(iter(models.items()))
        batch = max(map(int, args.batches.split(",")))
        per_step, top, host = profile_steps(path, device=args.device, dtype=args.dtype, batch=batch)
        for label, entries in (("PROFILE", top), ("PROFILE host", host)):
            for key, seconds, calls in entries:
                print(f"{label} {key[:70]}: {seconds * 1e3:.3f} ms in {calls} calls, "
                      f"{seconds / PROFILED_STEPS * 1e6:.1f} us a step", flush=True)
        where = "device" if args.device == "cuda" else "cpu"
        step = next(r for r in results if r["check"] == f"{name} decode step, batch {batch}")
        check(results, f"{name} profile, batch {batch}", **{f"{where}_ms_a_step": six_figures(per_step * 1e3)},
              step_ms=step["graphs_ms"])
    if args.serve:
        path = next(iter(models.values()))
        check(results, f"{path.name} served, 32 streams", output_tok_s=round(serve(path, args.device, args.out), 1))
    (args.out / "cuda_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
