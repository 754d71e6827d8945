#!/usr/bin/env python3
"""aserve and vLLM's CPU build, one after the other, on the same models and the same load.

    python scripts/bench_compare.py [--vllm-venv /tmp/vllm-cpu-venv] [--out results/compare.json]
                                    [--num-prompts 200] [--only LOAD ...] [--systems aserve vllm]
                                    [--client aserve|vllm] [--aserve-args "FLAGS"] [--vllm-args "FLAGS"]
                                    [--request-rate R]

Install the peer first (about 5 minutes; never a dependency of aserve):
``bash ../shared/peers/setup-vllm-cpu.sh /tmp/vllm-cpu-venv``.

Builds the benchmark models (random weights, fixed seed) into ``bench-models/``, then
for each model starts each server, waits for it to answer, drives it with the same
load (random dataset, 128 prompt tokens, 128 output tokens, ignore-eos, greedy, seed 0;
by default with ``aserve bench serve``, ``--client vllm`` uses ``vllm bench serve``
from the peer's venv), measures the whole process tree's memory (PSS, shared pages
split between processes) after the load, stops it, and prints one table with the
ratios aserve / vLLM. Configurations (``../shared/peers/README.md``):

- 7M Llama, float32 and bfloat16: aserve with ``--worker-threads 1`` vs vLLM with its
  default CPU binding (the model on one core: each one's best on a tiny model);
  concurrency 32 (``--num-prompts``) and concurrency 1 (a quarter as many);
- 152M Llama: aserve bfloat16 vs vLLM bfloat16 with both cores
  (``VLLM_CPU_OMP_THREADS_BIND=0-1``, its best here); concurrency 32;
- named in ``--only`` (``EXTRA``): float32, the MoE and its dense twin, concurrency 1 and
  128, 2,048-token prompts, and a shared 1,024-token prefix (docs/benchmarks.md).

Every load gets a freshly started server. ``--only 7m-float32-c32 ...`` picks loads,
``--systems aserve`` measures one system. ``--aserve-args`` / ``--vllm-args`` add flags to
one server's command line (say ``--aserve-args "--kv-cache-dtype bfloat16"``); the JSON
records them.

Both servers get a 4 GiB KV cache. JSON of every run goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from proc_stats import process_tree, pss_mib

ROOT = Path(__file__).resolve().parent.parent
PORT = 8731


class Running:
    """A server process group, started and waited for."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], probe: str, timeout: float = 600) -> None:
        self.name = name
        self.log = open(ROOT / "results" / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        url = f"http://127.0.0.1:{PORT}"
        try:
            httpx.get(url, timeout=1)
            raise SystemExit(f"port {PORT} is already serving: stop that server first")
        except httpx.TransportError:
            pass
        start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
        while True:
            try:
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                self.stop()
                raise SystemExit(f"{name} did not start; see results/{name}.log")
            time.sleep(0.25)  # polling for readiness, as a probe would
        self.ready_s = time.monotonic() - start

    def stop(self) -> None:
        """SIGTERM to the server's main process only (it stops its children, as Ctrl-C or
        a container stop would); anything of its session still alive 30 s after it
        exited is killed, so the next server has the machine (and the port) alone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 30
        while session_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if session_alive(self.proc.pid):
            print(f"{self.name}: processes left after exit; killing them", file=sys.stderr)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def session_alive(sid: int) -> bool:
    """Whether a live (not zombie) process of session ``sid`` remains."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            return True
    return False


@dataclass(frozen=True)
class Load:
    """One load: the model, its dtype, the streams, and the prompt and output lengths; a
    shared prefix of ``prefix_len`` tokens opens every prompt (prefix caching's case)."""

    size: str
    dtype: str
    concurrency: int
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 0

    @property
    def name(self) -> str:
        """``7m-float32-c32``, ``152m-bfloat16-c4-in2048``, ``7m-float32-c32-prefix1024``..."""
        name = f"{self.size}-{self.dtype}-c{self.concurrency}"
        if self.input_len != 128:
            name += f"-in{self.input_len}"
        if self.output_len != 128:
            name += f"-out{self.output_len}"
        if self.prefix_len:
            name += f"-prefix{self.prefix_len}"
        return name

    def num_prompts(self, at_32: int) -> int:
        """``--num-prompts`` is the count at 32 streams; a quarter of it (at least 8) at a
        few streams, more at more."""
        if self.concurrency <= 4:
            return max(8, at_32 // 4)
        return at_32 * max(1, self.concurrency // 32)


def load(args: argparse.Namespace, model: Path, spec: Load, prompts: int, tag: str) -> dict:
    out = ROOT / "results" / f"{tag}.json"
    common = ["--base-url", f"http://127.0.0.1:{PORT}", "--model", str(model), "--tokenizer", str(model),
              "--random-input-len", str(spec.input_len), "--random-output-len", str(spec.output_len),
              "--random-range-ratio", "0", "--num-prompts", str(prompts), "--max-concurrency", str(spec.concurrency),
              "--request-rate", str(args.request_rate), "--ignore-eos", "--seed", "0"]
    if args.client == "vllm":
        dataset = ["--dataset-name", "random"] + (["--random-prefix-len", str(spec.prefix_len)] if spec.prefix_len else [])
        cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
               "--endpoint", "/v1/completions", *dataset, *common, "--temperature", "0", "--save-result",
               "--result-filename", str(out)]
    else:
        dataset = (["--dataset-name", "prefix", "--prefix-len", str(spec.prefix_len)] if spec.prefix_len
                   else ["--dataset-name", "random"])
        cmd = [sys.executable, "-m", "aserve", "bench", "serve", *dataset, *common, "--no-progress",
               "--result-filename", str(out), *shlex.split(args.client_args)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.read_text())
    row = {k: result[k] for k in ("completed", "failed", "output_throughput", "median_ttft_ms", "median_itl_ms",
                                  "median_tpot_ms", "p99_ttft_ms", "duration")}
    if "by_kind" in result:
        row["by_kind"] = {kind: {k: part[k] for k in ("completed", "schema_shaped", "output_throughput",
                                                      "median_ttft_ms", "median_itl_ms")}
                          for kind, part in result["by_kind"].items()}
    return row


def serve_cmd(system: str, args: argparse.Namespace, model: Path, dtype: str, size: str) -> tuple[list[str], dict[str, str]]:
    if system == "aserve":
        # Its best here, as vLLM's below: one torch thread for the tiny model (the other
        # core serves HTTP and schedules), both cores for the 152M one.
        threads = ["--worker-threads", "1"] if size == "7m" else []
        return ([sys.executable, "-m", "aserve", "run", str(model), "--served-model-name", str(model), "--port",
                 str(PORT), "--dtype", dtype, "--log-level", "WARNING", *threads, *shlex.split(args.aserve_args)], {})
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if size != "7m":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
    return ([str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port",
             str(PORT), "--dtype", dtype, *shlex.split(args.vllm_args)], env)


#: The default plan; prompts: --num-prompts at concurrency 32, scaled with the streams.
PLAN = (
    Load("7m", "float32", 32), Load("7m", "float32", 1),
    Load("7m", "bfloat16", 32), Load("7m", "bfloat16", 1),
    Load("152m", "bfloat16", 32),
)
#: Run only when named in --only. On a CPU without native bf16 products (no avx512_bf16
#: or AMX, as on an AVX2 AMD EPYC) float32 is both systems' better 152M configuration.
#: The MoE (8 experts, top 2, 151M parameters) and the dense model of its active size;
#: concurrency 128; long prompts (prefill speed and TTFT); a shared 1,024-token prefix.
EXTRA = (
    Load("152m", "float32", 32), Load("moe-150m", "float32", 32), Load("dense-52m", "float32", 32),
    Load("moe-150m", "bfloat16", 32), Load("dense-52m", "bfloat16", 32),
    Load("7m", "float32", 128), Load("152m", "bfloat16", 1), Load("152m", "bfloat16", 128),
    Load("152m", "float32", 1), Load("152m", "float32", 128),
    Load("7m", "float32", 4, input_len=2048), Load("152m", "bfloat16", 4, input_len=2048),
    Load("152m", "float32", 4, input_len=2048),
    Load("7m", "float32", 32, prefix_len=1024), Load("152m", "bfloat16", 32, prefix_len=1024),
    Load("152m", "float32", 32, prefix_len=1024),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--out", default=str(ROOT / "results" / "compare.json"))
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--only", nargs="+", metavar="LOAD",
                        help="run only these loads, named like 7m-float32-c32 (default: all)")
    parser.add_argument("--systems", nargs="+", default=["aserve", "vllm"], choices=("aserve", "vllm"))
    parser.add_argument("--client", choices=("aserve", "vllm"), default="aserve")
    parser.add_argument("--aserve-args", default="", help="more flags for aserve run")
    parser.add_argument("--vllm-args", default="", help="more flags for vllm serve")
    parser.add_argument("--request-rate", default="inf",
                        help="requests a second, Poisson arrivals (default inf: every stream sends its next "
                             "request as its last ends); a fixed rate gives both servers the same prefill demand")
    parser.add_argument("--client-args", default="",
                        help="more flags for aserve bench serve (say \"--structured json_schema\")")
    args = parser.parse_args()
    (ROOT / "results").mkdir(exist_ok=True)
    systems = [s for s in args.systems if s == "aserve" or (Path(args.vllm_venv) / "bin" / "vllm").exists()]
    if "vllm" in args.systems and "vllm" not in systems:
        print(f"no vLLM at {args.vllm_venv}: measuring aserve only", file=sys.stderr)
    models = {"7m": ROOT / "bench-models" / "llama-7m", "152m": ROOT / "bench-models" / "llama-152m",
              "moe-150m": ROOT / "bench-models" / "moe-150m", "dense-52m": ROOT / "bench-models" / "dense-52m"}
    plan = [p for p in PLAN + EXTRA if (args.only is None and p in PLAN) or (args.only is not None and p.name in args.only)]
    if args.only is not None and len(plan) < len(args.only):
        known = ", ".join(p.name for p in PLAN + EXTRA)
        raise SystemExit(f"unknown load in --only {' '.join(args.only)}; the loads are: {known}")
    for size in dict.fromkeys(p.size for p in plan):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_bench_model.py"), str(models[size]), "--size",
                        size], check=True, stdout=subprocess.DEVNULL)
    rows: dict = {}
    for spec in plan:
        size, dtype, key = spec.size, spec.dtype, spec.name
        prompts = spec.num_prompts(args.num_prompts)
        for system in systems:
            # A fresh server for every load: after a concurrency-32 run, vLLM sent the
            # streams of a following concurrency-1 run in bursts.
            cmd, env = serve_cmd(system, args, models[size], dtype, size)
            # aserve answers HTTP while loading (/ready 503); vLLM listens once loaded (/health).
            server = Running(f"{system}-{key}", cmd, env, "/ready" if system == "aserve" else "/health")
            try:
                print(f"{system}: {key} ...", file=sys.stderr, flush=True)
                result = load(args, models[size], spec, prompts, f"{system}-{key}")
                result["pss_mib"] = pss_mib(process_tree(server.proc.pid))
                result["ready_s"] = server.ready_s
                result["server_cmd"] = cmd
                result["request_rate"] = args.request_rate
                rows.setdefault(key, {})[system] = result
            finally:
                server.stop()
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"\n{'load':<30}{'system':<8}{'out tok/s':>10}{'TTFT p50':>10}{'ITL p50':>9}{'PSS MiB':>9}{'ready s':>8}")
    for key, by_system in rows.items():
        for system, r in by_system.items():
            print(f"{key:<30}{system:<8}{r['output_throughput']:>10.1f}{r['median_ttft_ms']:>10.1f}"
                  f"{r['median_itl_ms']:>9.2f}{r['pss_mib']:>9.0f}{r['ready_s']:>8.1f}")
        if "vllm" in by_system and "aserve" in by_system:
            a, v = by_system["aserve"], by_system["vllm"]
            print(f"{'':<30}{'ratio':<8}{a['output_throughput'] / v['output_throughput']:>10.2f}"
                  f"{a['median_ttft_ms'] / v['median_ttft_ms']:>10.2f}{a['median_itl_ms'] / v['median_itl_ms']:>9.2f}"
                  f"{a['pss_mib'] / v['pss_mib']:>9.2f}")


if __name__ == "__main__":
    main()
