"""scripts/prefill_roofline.py: a long prompt's prefill step against its projections at
the measured GEMM rate (issue 27's prefill target)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reports_the_prefill_against_its_projections_at_the_gemm_rate(llama_dir, dtype):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prefill_roofline.py"), "--model", str(llama_dir), "--dtype", dtype,
         "--prompt-len", "48", "--prompts", "3", "--repeats", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    # The products timed are the checkpoint's projections: a layer's K x N summed over
    # them is its linear weights' size (q, k, v, o, gate, up, down; no norms).
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.endswith("proj.weight")]
        per_layer = sum(math.prod(f.get_slice(n).get_shape()) for n in names)
    config = json.loads((llama_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert len(names) == 7 * layers
    for row in rows:
        assert row["prompt_len"] == 48 and row["prefill_ms"] > 0 and row["gemm_ms"] > 0
        assert set(row["gemm_ms_by_product"]) == {"qkv", "o_proj", "gate_up", "down"}
        # Times to 4 significant figures, rates to whole units, the ratio to 0.001.
        assert abs(sum(row["gemm_ms_by_product"].values()) - row["gemm_ms"]) <= 0.002 * row["gemm_ms"]
        flops = 2 * 48 * per_layer
        assert abs(row["gemm_gflops"] - flops / (row["gemm_ms"] * 1e-3) / 1e9) <= 0.002 * row["gemm_gflops"] + 1
        ratio = row["gemm_ms"] / row["prefill_ms"]
        assert abs(row["prefill_over_gemm_rate"] - ratio) <= 0.002 * ratio + 0.0005
        assert abs(row["prefill_tok_s"] - 48 / (row["prefill_ms"] * 1e-3)) <= 0.002 * row["prefill_tok_s"] + 1
        assert abs(row["gemm_tok_s"] - 48 / (row["gemm_ms"] * 1e-3)) <= 0.002 * row["gemm_tok_s"] + 1


def test_refuses_a_single_prompt():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prefill_roofline.py"), "--prompts", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--prompts must be at least 2" in out.stderr
