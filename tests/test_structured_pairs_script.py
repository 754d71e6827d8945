"""scripts/structured_pairs.py: unconstrained and half-constrained loads alternating on one
server, each half-constrained one set against its neighbours, with the CPU of each server
process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_alternates_the_loads_and_reports_the_ratio_and_each_process_cpu(llama_dir, tmp_path):
    out_file = tmp_path / "pairs.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structured_pairs.py"), "--model", str(llama_dir), "--pairs", "1",
         "--num-prompts", "8", "--out", str(out_file)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    report = json.loads(out_file.read_text())
    rows = report["rows"]
    assert [r["fraction"] for r in rows] == [0.0, 0.5, 0.0]  # unconstrained on both sides
    assert rows[1]["schema_shaped"] == "4/4"  # the constraint held on every constrained request
    for row in rows:
        assert row["output_tok_s"] > 0 and row["unconstrained_itl_p50_ms"] > 0
        assert row["cpu_s_per_1k_tokens"]["worker"] > 0 and row["cpu_s_per_1k_tokens"]["engine"] > 0
    free = [rows[0]["unconstrained_itl_p50_ms"], rows[2]["unconstrained_itl_p50_ms"]]
    expected = rows[1]["unconstrained_itl_p50_ms"] / (sum(free) / 2)
    assert report["summary"]["half_over_neighbours"] == [round(expected, 3)]
