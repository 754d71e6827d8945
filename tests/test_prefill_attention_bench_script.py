"""scripts/prefill_attention_bench.py: the bf16 prefill-attention kernel timed alone, and
alternated with another checkout's after comparing their bits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.cpu_marks import needs_bf16_kernel

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "prefill_attention_bench.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--shape", "7m", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300)


@needs_bf16_kernel
def test_times_each_length_and_compares_bits(tmp_path):
    same = run("--tokens", "40", "300", "--rounds", "2", "--against", str(ROOT))
    assert same.returncode == 0, same.stderr
    heads = [line for line in same.stdout.splitlines() if not line.startswith(" ")]
    assert heads == [f"7m shape, {n} tokens, 1 threads; the same bits as --against: yes" for n in (40, 300)]
    rows = re.findall(r"round (\d) (this|against)\s+([\d.]+) ms a layer\s+(\d+) GFLOP/s", same.stdout)
    assert [(r, who) for r, who, _, _ in rows] == [("1", "this"), ("1", "against"), ("2", "this"),
                                                   ("2", "against")] * 2
    assert all(float(ms) > 0 and int(gflops) > 0 for _, _, ms, gflops in rows)

    # A checkout whose softmax weights differ (the cubic's constant term) gives other bits.
    other = tmp_path / "other"
    shutil.copytree(ROOT / "aserve", other / "aserve", ignore=shutil.ignore_patterns("__pycache__"))
    common = other / "aserve" / "kernels" / "cpu_prefill_common.h"
    text = common.read_text()
    assert text.count("0.99992526f") == 1
    common.write_text(text.replace("0.99992526f", "0.9f"))
    differ = run("--tokens", "40", "--rounds", "1", "--against", str(other))
    assert differ.returncode == 0, differ.stderr
    assert "7m shape, 40 tokens, 1 threads; the same bits as --against: no" in differ.stdout


def test_refuses_a_directory_without_aserve(tmp_path):
    out = run("--tokens", "40", "--rounds", "1", "--against", str(tmp_path))
    assert out.returncode != 0
    assert f"{tmp_path} has no aserve package of its own" in out.stderr or "no bf16 prefill-attention kernel" in out.stderr
