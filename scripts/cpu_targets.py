#!/usr/bin/env python3
"""Issue 27's CPU targets, measured on the CPU at hand, each read as met or not.

    python scripts/cpu_targets.py [--vllm-venv /tmp/vllm-cpu-venv] [--pairs 3]
                                  [--out results/targets.json] [--from results/targets.json]

The targets are read against vLLM's CPU build run side by side on the same machine
(``scripts/bench_compare.py``, each load a fresh server of each system) and against the
machine's own rooflines (``scripts/decode_roofline.py``, ``scripts/prefill_roofline.py``):

- 7M float32 at concurrency 32: at least 1.5x vLLM's output tokens/s, ITL p50 no worse;
- 7M float32 at concurrency 1: ITL p50 no worse;
- 152M at concurrency 32: at least 1.5x; its decode step within 15% of the floor;
- long prompts (2,048 in / 128 out, concurrency 4, 7M and 152M): TTFT p50 no worse; the
  152M prefill within 25% of the GEMM rate at that shape (a ratio of at least 0.75);
- a shared 1,024-token prefix (152M, concurrency 32): at least 1.2x.

The 152M model runs in bfloat16 where the CPU has bf16 products (``avx512_bf16`` or
AMX), else in float32, each system's better configuration there. Each load runs
``--pairs`` times, a pair at a time; a target is met when every pair meets it (the
median is printed too: the machines are VMs whose rates move within the hour). The
first line printed is the CPU and its kernel-relevant flags, which every figure recorded
from this output must name. ``--out`` keeps the raw rows; ``--from`` reads such a file
back and prints the verdicts without measuring.

After the verdicts it prints the 152M c = 32 load's floor on this machine
(:func:`load_floor`): the output tokens/s no server could beat at this machine's GEMM
and read rates, and where aserve, vLLM and the 1.5x target stand against it. Where
1.5x vLLM is most of the floor, the target asks for more than the hardware leaves.

One pair took 18 minutes on the AMX kind (2026-12-05; vLLM's servers take about a minute
each to start). Run nothing else meanwhile: two cores are the whole machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from aserve.kernels.cbuild import cpu_flags  # noqa: E402
from aserve.kernels.inventory import describe  # noqa: E402
from bench_compare import Load  # noqa: E402


def dtype_152m(flags: frozenset[str] | None) -> str:
    """bfloat16 where the CPU multiplies bf16 natively, else float32."""
    flags = flags or frozenset()
    return "bfloat16" if "avx512_bf16" in flags or {"amx_tile", "amx_bf16"} <= flags else "float32"


def loads(dtype: str) -> dict[str, str]:
    """The loads the targets read, by role, named as ``bench_compare.py --only`` takes them."""
    plan = {"7m_c32": Load("7m", "float32", 32), "7m_c1": Load("7m", "float32", 1),
            "152m_c32": Load("152m", dtype, 32), "7m_long": Load("7m", "float32", 4, input_len=2048),
            "152m_long": Load("152m", dtype, 4, input_len=2048), "152m_prefix": Load("152m", dtype, 32, prefix_len=1024)}
    return {role: load.name for role, load in plan.items()}


@dataclasses.dataclass
class Verdict:
    """One target: what it asks, the value of each pair (or repeat), and whether every
    one of them meets it (None where nothing was measured)."""

    target: str
    values: list[float]
    met: bool | None
    unit: str

    def line(self) -> str:
        if not self.values:
            return f"{self.target}: not measured"
        shown = ", ".join(f"{v:.2f}" for v in self.values)
        median = statistics.median(self.values)
        verdict = "MET" if self.met else "not met"
        return f"{self.target}: {shown} {self.unit} (median {median:.2f}): {verdict}"


def _pairs(rows: dict[str, list[dict]], load: str) -> list[tuple[dict, dict]]:
    """(aserve, vllm) rows of each run of a load that both systems completed."""
    return [(run["aserve"], run["vllm"]) for run in rows.get(load, []) if "aserve" in run and "vllm" in run]


def _ratio_target(target: str, pairs: list[tuple[dict, dict]], key: str, at_least: float | None = None,
                  at_most: float | None = None, unit: str = "x vLLM") -> Verdict:
    values = [a[key] / v[key] for a, v in pairs if v[key] > 0]
    if not values:
        return Verdict(target, [], None, unit)
    ok = all((at_least is None or x >= at_least) and (at_most is None or x <= at_most) for x in values)
    return Verdict(target, values, ok, unit)


def evaluate(rows: dict[str, list[dict]], decode: list[dict], prefill: list[dict], dtype: str) -> list[Verdict]:
    """The verdicts from bench_compare rows (load -> one ``{system: row}`` per run), the
    decode roofline's JSON lines and the prefill roofline's."""
    name = loads(dtype)
    out = [
        _ratio_target("7M c=32 output tok/s, at least 1.5x", _pairs(rows, name["7m_c32"]), "output_throughput",
                      at_least=1.5),
        _ratio_target("7M c=32 ITL p50, no worse", _pairs(rows, name["7m_c32"]), "median_itl_ms", at_most=1.0),
        _ratio_target("7M c=1 ITL p50, no worse", _pairs(rows, name["7m_c1"]), "median_itl_ms", at_most=1.0),
        _ratio_target(f"152M {dtype} c=32 output tok/s, at least 1.5x", _pairs(rows, name["152m_c32"]),
                      "output_throughput", at_least=1.5),
    ]
    steps = [r["step_over_floor"] for r in decode]
    out.append(Verdict(f"152M {dtype} decode step, within 15% of the floor", steps,
                       all(s <= 1.15 for s in steps) if steps else None, "x the floor"))
    out += [
        _ratio_target("7M long prompts TTFT p50, no worse", _pairs(rows, name["7m_long"]), "median_ttft_ms",
                      at_most=1.0),
        _ratio_target(f"152M {dtype} long prompts TTFT p50, no worse", _pairs(rows, name["152m_long"]),
                      "median_ttft_ms", at_most=1.0),
    ]
    rates = [r["prefill_over_gemm_rate"] for r in prefill]
    out.append(Verdict(f"152M {dtype} prefill at 2,048 tokens, at least 0.75 of the GEMM rate", rates,
                       all(r >= 0.75 for r in rates) if rates else None, "of the GEMM rate"))
    out.append(_ratio_target(f"152M {dtype} shared prefix output tok/s, at least 1.2x",
                             _pairs(rows, name["152m_prefix"]), "output_throughput", at_least=1.2))
    return out


def load_floor(decode_row: dict, input_len: int = 128, output_len: int = 128) -> float:
    """Output tokens/s of the 152M load at concurrency 32 (``input_len`` in,
    ``output_len`` out) at this machine's floor, from one ``decode_roofline.py`` line
    measured at that load's shape (its batch of 32 rows at the same mean context).

    Each output token costs its decode step's floor over the batch (the larger of the
    weights' read and the linear layers' arithmetic, plus the keys and values read); each
    prompt token the linear layers' arithmetic alone at the machine's GEMM rate. Left out,
    so that the floor stays a bound: prefill attention, the KV writes, the LM head's
    saving on prompt tokens (it runs once a prompt; 0.3% of the 152M's weights), and any
    time between steps."""
    batch = decode_row.get("batch", 32)
    per_output_ms = decode_row["floor_ms"] / batch + input_len / output_len * decode_row["linear_compute_ms"] / batch
    return 1000.0 / per_output_ms


def floor_line(rows: dict[str, list[dict]], decode: list[dict], dtype: str) -> str | None:
    """The 152M c = 32 load against its floor (medians over the runs), or None where
    either side was not measured."""
    pairs = _pairs(rows, loads(dtype)["152m_c32"])
    floors = [load_floor(r) for r in decode if "floor_ms" in r and "linear_compute_ms" in r]
    if not pairs or not floors:
        return None
    floor = statistics.median(floors)
    ours = statistics.median(a["output_throughput"] for a, _ in pairs)
    theirs = statistics.median(v["output_throughput"] for _, v in pairs)
    return (f"152M {dtype} c=32 load floor on this machine: {floor:.0f} output tok/s; aserve {ours / floor:.2f}, "
            f"vLLM {theirs / floor:.2f} of it; 1.5x vLLM would be {1.5 * theirs / floor:.2f} of it")


def _json_lines(cmd: list[str]) -> list[dict]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def measure(args: argparse.Namespace, dtype: str) -> dict:
    """Runs every load ``--pairs`` times (one bench_compare call a load and pair, both
    systems), then the two rooflines once a pair."""
    rows: dict[str, list[dict]] = {}
    decode: list[dict] = []
    prefill: list[dict] = []
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for load in loads(dtype).values():
                out = Path(tmp) / f"{load}-{pair}.json"
                subprocess.run([py, str(ROOT / "scripts" / "bench_compare.py"), "--vllm-venv", args.vllm_venv,
                                "--only", load, "--out", str(out)], check=True)
                rows.setdefault(load, []).append(json.loads(out.read_text())[load])
            decode += _json_lines([py, str(ROOT / "scripts" / "decode_roofline.py"), "--dtype", dtype,
                                   "--repeats", "1"])
            prefill += _json_lines([py, str(ROOT / "scripts" / "prefill_roofline.py"), "--dtype", dtype,
                                    "--repeats", "1"])
    return {"cpu": describe(), "dtype_152m": dtype, "rows": rows, "decode_roofline": decode,
            "prefill_roofline": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "targets.json"))
    parser.add_argument("--from", dest="source", metavar="FILE", help="print the verdicts of a saved run")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.source:
        result = json.loads(Path(args.source).read_text())
    else:
        if not (Path(args.vllm_venv) / "bin" / "vllm").exists():
            parser.error(f"no vLLM at {args.vllm_venv}: the targets are ratios against it "
                         "(bash ../shared/peers/setup-vllm-cpu.sh /tmp/vllm-cpu-venv)")
        result = measure(args, dtype_152m(cpu_flags()))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["cpu"])
    for verdict in evaluate(result["rows"], result["decode_roofline"], result["prefill_roofline"],
                            result["dtype_152m"]):
        print(verdict.line())
    line = floor_line(result["rows"], result["decode_roofline"], result["dtype_152m"])
    if line:
        print(line)


if __name__ == "__main__":
    main()
