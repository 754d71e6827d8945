"""scripts/decode_roofline.py: the decode step against its floor (the bytes it reads, or
the linear layers' arithmetic at the measured GEMM rate where that is longer)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype,kv_cache_dtype,weight_size,kv_size,block_size", [
    ("bfloat16", "auto", 2, 2, "16"),
    # --kv-cache-dtype: the keys and values at 2 bytes; a block size that splits the prompts
    ("float32", "bfloat16", 4, 2, "4"),
])
def test_reports_the_step_against_the_bytes_it_reads(llama_dir, dtype, kv_cache_dtype, weight_size, kv_size,
                                                      block_size):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_roofline.py"), "--model", str(llama_dir), "--batch", "4",
         "--prompt-len", "8", "--output-len", "5", "--repeats", "2", "--dtype", dtype,
         "--kv-cache-dtype", kv_cache_dtype, "--block-size", block_size],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    # The weights a step reads: every tensor of the checkpoint but the embedding table
    # (the step reads only its batch's rows of it), at the dtype's size.
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if "embed_tokens" not in name)
    config = json.loads((llama_dir / "config.json").read_text())
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * kv_size
    for row in rows:
        assert row["weight_bytes"] == weight_size * numel
        assert row["kv_bytes"] == 4 * (8 + 5 / 2) * kv_per_token  # batch x the mean context
        assert row["read_gb_s"] > 0 and row["decode_step_ms"] > 0
        assert (row["batch"], row["prompt_len"], row["output_len"]) == (4, 8, 5)  # the shape the figures are of
        # The read rate is printed to 0.1 GB/s, the GEMM rate to 4 significant figures (a plain
        # bf16 product on an AVX2 CPU runs at a few tens of GFLOP/s), the ratio to 0.01.
        memory_ms = (row["weight_bytes"] + row["kv_bytes"]) / (row["read_gb_s"] * 1e9) * 1e3
        assert abs(row["memory_floor_ms"] - memory_ms) <= 0.01 * memory_ms
        compute_ms = 2 * 4 * numel / (row["gemm_gflops"] * 1e9) * 1e3  # batch 4, two FLOPs a weight a row
        assert abs(row["linear_compute_ms"] - compute_ms) <= 0.01 * compute_ms
        weights_ms = row["weight_bytes"] / (row["read_gb_s"] * 1e9) * 1e3
        floor_ms = max(weights_ms, compute_ms) + (memory_ms - weights_ms)
        assert abs(row["floor_ms"] - floor_ms) <= 0.01 * floor_ms and row["floor_ms"] >= 0.99 * memory_ms
        assert abs(row["step_over_floor"] - row["decode_step_ms"] / row["floor_ms"]) <= 0.02 * row["step_over_floor"]


def test_hands_the_block_size_to_the_engine(llama_dir):
    """--block-size reaches the engine's own check (a power of two)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_roofline.py"), "--model", str(llama_dir), "--batch", "2",
         "--prompt-len", "4", "--output-len", "2", "--repeats", "1", "--block-size", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0 and "block_size must be a power of two, got 3" in out.stderr
