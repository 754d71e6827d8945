"""scripts/cuda_bench.py, the speed part of scripts/cuda_check.sh, run on the CPU (its
``--device cpu`` mode: the same steps, no graphs there) so that the one prepared GPU run
does not fail on the script itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_reports_each_decode_step_against_its_floor_and_the_graphs_tokens(llama_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cuda_bench.py"), "--device", "cpu", "--model-dir", str(llama_dir),
         "--batches", "1,3", "--dtype", "float32", "--profile", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    results = json.loads((tmp_path / "cuda_bench.json").read_text())
    assert len(lines) == len(results) == 6  # bandwidth, a step and a tokens line per batch, the profile
    assert results[0]["gb_s"] > 0
    for batch, step, tokens in ((1, results[1], results[2]), (3, results[3], results[4])):
        assert step["check"].endswith(f"batch {batch}") and step["floor_ms"] > 0 and step["graphs_ms"] > 0
        # The ratio is rounded to 2 places and each time to 6 significant figures.
        ratio = step["graphs_ms"] / step["floor_ms"]
        assert abs(step["graphs_over_floor"] - ratio) <= 0.005 + 1e-4 * ratio
        assert tokens["equal_to_eager"] == f"{batch}/{batch}"
    profile = results[5]
    assert profile["check"].endswith("profile, batch 3") and profile["cpu_ms_a_step"] > 0
    assert profile["step_ms"] == results[3]["graphs_ms"]
    assert sum(line.startswith("PROFILE ") for line in out.stdout.splitlines()) == 12
