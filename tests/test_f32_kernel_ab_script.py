"""scripts/f32_kernel_ab.py: the float32 kernel (or the one-call decode step) of a git
revision against the working tree's, alternating in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aserve.kernels import f32_linear

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "f32_kernel_ab.py")

pytestmark = pytest.mark.skipif(f32_linear.load() is None,
                                reason="this CPU lacks AVX2 + FMA: the float32 kernel does not build here")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_times_both_builds_of_the_kernel_for_each_shape_and_row_count():
    out = _run("--before", "HEAD", "--shapes", "7m", "--rows", "2", "7", "--weights", "1", "--rounds", "2",
               "--threads", "1")
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [(w[0], w[1]) for w in lines] == [(s, r) for s in ("qkv", "o_proj", "gate_up", "down") for r in ("2", "7")]
    for w in lines:  # "<shape> <rows> rows before a b after c d GFLOP/s"
        assert w[3] == "before" and w[6] == "after" and w[-1] == "GFLOP/s"
        assert all(float(v) > 0 for v in w[4:6] + w[7:9])


def test_swaps_the_decode_step_between_the_builds_call_by_call(llama_dir):
    out = _run("--before", "HEAD", "--decode-step", str(llama_dir), "--batch", "2", "--output-len", "3", "--rounds", "2")
    assert out.returncode == 0, out.stderr
    medians = {line.split(":")[0]: line for line in out.stdout.splitlines() if "median stack" in line}
    assert set(medians) == {"before", "after"}  # each ran its rounds with the first call's tokens
    assert all(len(line.split("stack ")[1].split(" ms")[0].split()) == 2 for line in medians.values())


def test_a_revision_that_does_not_exist_is_refused():
    out = _run("--before", "no-such-revision-here", "--rows", "2", "--weights", "1", "--rounds", "1")
    assert out.returncode != 0
