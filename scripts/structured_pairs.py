#!/usr/bin/env python3
"""Does a half-constrained load slow the unconstrained requests? Loads alternating on one server.

    python scripts/structured_pairs.py [--model bench-models/llama-7m] [--pairs 4]
                                       [--num-prompts 400] [--fraction 0.5] [--out results/pairs.json]
                                       [--aserve-args "FLAGS"]

Starts one aserve server (the 7M model in float32, ``--worker-threads 1``, as
``bench_compare.py`` runs it), warms it with one load of each kind, then runs
``--pairs`` pairs of the same 128 in / 128 out, ignore-eos, greedy, 32-stream load: first
with no constraint, then with ``--fraction`` of its requests under ``aserve bench
serve``'s ``--structured json_schema``. For every load it reports output tok/s, the
unconstrained requests' median ITL, and each server process's CPU time per 1,000 output
tokens (``/proc``), so an extra cost shows where it is paid. The noise is the spread of
the unconstrained loads among themselves; the verdict compares each half-constrained
load with the unconstrained loads either side of it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_compare import PORT, ROOT, Running
from proc_stats import cpu_seconds, process_tree


#: The part a server process plays, by the start of its title (``aserve::worker_tp0``,
#: ``aserve::engine_core_0``...: ``aserve.process.utils.set_process_title``).
ROLES = {"worker": "worker", "engine_core": "engine", "api_server": "api", "coordinator": "coordinator",
         "supervisor": "supervisor"}


def role(pid: int) -> str:
    """A server process's part, from the title it set; anything else by its command."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except FileNotFoundError:
        return "gone"
    name = title.removeprefix("aserve::")
    return next((label for prefix, label in ROLES.items() if name.startswith(prefix)), name)


def cpu_by_role(root: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in process_tree(root):
        name = role(pid)
        out[name] = out.get(name, 0.0) + cpu_seconds(pid)
    return out


def load(args: argparse.Namespace, model: Path, fraction: float, server_pid: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
               "--model", str(model), "--num-prompts", str(args.num_prompts), "--max-concurrency", "32",
               "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos", "--no-progress",
               "--result-filename", f.name]
        if fraction > 0:
            cmd += ["--structured", "json_schema", "--structured-fraction", str(fraction)]
        before = cpu_by_role(server_pid)
        client = subprocess.run(cmd, capture_output=True, text=True)
        after = cpu_by_role(server_pid)
        if client.returncode != 0:
            raise SystemExit(f"the client failed:\n{client.stderr}")
        result = json.loads(Path(f.name).read_text())
    tokens = result["total_output_tokens"]
    free = result["by_kind"]["unconstrained"] if fraction > 0 else result
    row = {"fraction": fraction, "output_tok_s": round(result["output_throughput"], 1),
           "unconstrained_itl_p50_ms": round(free["median_itl_ms"], 3),
           "cpu_s_per_1k_tokens": {k: round((after[k] - before.get(k, 0.0)) * 1000 / tokens, 4) for k in after}}
    if fraction > 0:
        part = result["by_kind"]["constrained"]
        row["schema_shaped"] = f"{part['schema_shaped']}/{part['completed']}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "bench-models" / "llama-7m")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--aserve-args", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "structured-pairs.json")
    args = parser.parse_args()
    (ROOT / "results").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "aserve", "run", str(args.model), "--served-model-name", str(args.model),
           "--port", str(PORT), "--dtype", "float32", "--log-level", "WARNING", "--worker-threads", "1",
           *shlex.split(args.aserve_args)]
    server = Running("structured-pairs", cmd, {}, "/ready")
    rows = []
    try:
        for fraction in (0.0, args.fraction):  # warm-up: the first load of each kind is the slowest
            load(args, args.model, fraction, server.proc.pid)
        for _ in range(args.pairs):
            for fraction in (0.0, args.fraction):
                rows.append(load(args, args.model, fraction, server.proc.pid))
                print(json.dumps(rows[-1]), flush=True)
        rows.append(load(args, args.model, 0.0, server.proc.pid))  # closes the last pair's bracket
        print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    free = [r["unconstrained_itl_p50_ms"] for r in rows if r["fraction"] == 0]
    half = [r["unconstrained_itl_p50_ms"] for r in rows if r["fraction"] > 0]
    ratios = [h / ((free[i] + free[i + 1]) / 2) for i, h in enumerate(half)]
    noise = [free[i + 1] / free[i] for i in range(len(free) - 1)]
    summary = {"half_over_neighbours": [round(r, 3) for r in ratios],
               "mean_ratio": round(statistics.mean(ratios), 3),
               "unconstrained_successive_ratios": [round(r, 3) for r in noise]}
    print(json.dumps(summary))
    args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
