"""scripts/gemm_roofline.py: GFLOP/s of each way aserve could multiply at the 152M
model's shapes, its own kernel beside oneDNN's where this CPU runs one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aserve.kernels import f32_linear

ROOT = Path(__file__).resolve().parent.parent


def test_reports_each_kernel_per_row_count():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gemm_roofline.py"), "--rows", "8", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    f32 = [r for r in rows if r.get("dtype") == "float32"]
    assert [r["M"] for r in f32] == [8]  # --rows replaces the default 32 and 4096
    assert f32[0]["layer_gflops_plain"] > 0 and f32[0]["layer_gflops_packed"] > 0
    # aserve's float32 kernel is timed exactly where it loads on this CPU.
    if f32_linear.load() is None:
        assert f32[0]["layer_gflops_aserve"] is None
    else:
        assert f32[0]["layer_gflops_aserve"] > 0
    assert rows[-1]["copy_gb_s"] > 0
