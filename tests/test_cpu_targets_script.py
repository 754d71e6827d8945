"""scripts/cpu_targets.py: issue 27's targets read from side-by-side runs and rooflines."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cpu_targets.py"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_targets"] = module  # the dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def _row(tok_s: float, itl: float, ttft: float) -> dict:
    return {"output_throughput": tok_s, "median_itl_ms": itl, "median_ttft_ms": ttft}


def _result(dtype: str) -> dict:
    """Two runs of each load; the 152M c = 32 load misses 1.5x in its second run."""
    name = _module().loads(dtype)
    rows = {
        name["7m_c32"]: [{"aserve": _row(900, 4.0, 80), "vllm": _row(500, 5.0, 90)},
                         {"aserve": _row(800, 4.0, 80), "vllm": _row(500, 4.0, 90)}],
        name["7m_c1"]: [{"aserve": _row(100, 0.8, 8), "vllm": _row(90, 0.9, 8)}] * 2,
        name["152m_c32"]: [{"aserve": _row(800, 30, 500), "vllm": _row(500, 47, 800)},
                           {"aserve": _row(740, 30, 500), "vllm": _row(500, 47, 800)}],
        name["152m_prefix"]: [{"aserve": _row(650, 30, 500), "vllm": _row(450, 47, 800)}] * 2,
        # No long-prompt runs of the 7M model; one of the 152M model.
        name["152m_long"]: [{"aserve": _row(50, 44, 1100), "vllm": _row(42, 61, 1600)}],
    }
    return {"cpu": "CPU: test; flags: avx2 fma", "dtype_152m": dtype, "rows": rows,
            "decode_roofline": [{"step_over_floor": 1.32, "batch": 32, "floor_ms": 28.0, "linear_compute_ms": 22.0},
                                {"step_over_floor": 1.36, "floor_ms": 30.0, "linear_compute_ms": 20.0}],
            "prefill_roofline": [{"prefill_over_gemm_rate": 0.52}, {"prefill_over_gemm_rate": 0.8}]}


def test_a_target_is_met_only_when_every_run_meets_it():
    m = _module()
    result = _result("bfloat16")
    verdicts = {v.target: v for v in m.evaluate(result["rows"], result["decode_roofline"],
                                                 result["prefill_roofline"], "bfloat16")}
    tput = verdicts["7M c=32 output tok/s, at least 1.5x"]
    assert tput.values == [1.8, 1.6] and tput.met is True
    # ITL 4.0 against 5.0 and 4.0: equal is no worse.
    assert verdicts["7M c=32 ITL p50, no worse"].values == [0.8, 1.0]
    assert verdicts["7M c=32 ITL p50, no worse"].met is True
    c32 = verdicts["152M bfloat16 c=32 output tok/s, at least 1.5x"]
    assert c32.values == [1.6, 1.48] and c32.met is False
    assert "median 1.54" in c32.line() and c32.line().endswith("not met")
    assert verdicts["152M bfloat16 decode step, within 15% of the floor"].met is False
    assert verdicts["152M bfloat16 prefill at 2,048 tokens, at least 0.75 of the GEMM rate"].met is False
    assert verdicts["152M bfloat16 shared prefix output tok/s, at least 1.2x"].met is True
    assert verdicts["152M bfloat16 long prompts TTFT p50, no worse"].values == [1100 / 1600]
    missing = verdicts["7M long prompts TTFT p50, no worse"]
    assert missing.met is None and missing.line().endswith("not measured")


def test_the_152m_model_runs_in_bf16_only_where_the_cpu_multiplies_it():
    m = _module()
    assert m.dtype_152m(frozenset({"avx2", "fma"})) == "float32"
    assert m.dtype_152m(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})) == "bfloat16"
    assert m.dtype_152m(frozenset({"avx512f", "amx_tile", "amx_bf16"})) == "bfloat16"
    assert m.dtype_152m(None) == "float32"
    assert m.loads("float32")["152m_c32"] == "152m-float32-c32"


def test_prints_the_verdicts_of_a_saved_run(tmp_path):
    saved = tmp_path / "targets.json"
    saved.write_text(json.dumps(_result("float32")))
    out = subprocess.run([sys.executable, str(SCRIPT), "--from", str(saved)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "CPU: test; flags: avx2 fma"
    assert len(lines) == 1 + 9 + 1
    assert "152M float32 c=32 output tok/s, at least 1.5x: 1.60, 1.48 x vLLM (median 1.54): not met" in lines


def test_refuses_to_measure_without_the_peer(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no vLLM at" in out.stderr


def test_the_load_floor_counts_each_output_token_a_decode_floor_and_each_prompt_token_its_products():
    m = _module()
    row = {"batch": 32, "floor_ms": 28.0, "linear_compute_ms": 22.0}
    # 128 in / 128 out: (28 + 22) ms for 32 output tokens.
    assert m.load_floor(row) == 1000 * 32 / 50
    # Twice the prompt per output token doubles the prefill's share; a row without its
    # batch (older decode_roofline.py lines) is read as 32 rows.
    assert m.load_floor({"floor_ms": 28.0, "linear_compute_ms": 22.0}, input_len=256) == 1000 * 32 / 72
    result = _result("bfloat16")
    # Floors 640 and 640 tok/s (30 + 20 ms too); aserve's median 770, vLLM's 500.
    line = m.floor_line(result["rows"], result["decode_roofline"], "bfloat16")
    assert line == ("152M bfloat16 c=32 load floor on this machine: 640 output tok/s; aserve 1.20, vLLM 0.78 of it; "
                    "1.5x vLLM would be 1.17 of it")
    assert m.floor_line(result["rows"], [{"step_over_floor": 1.3}], "bfloat16") is None
    assert m.floor_line({}, result["decode_roofline"], "bfloat16") is None
