"""Every Triton kernel compiles to machine code for Hopper and Ampere GPUs (PTX, then a
cubin through the ``ptxas`` in Triton's wheel), checked here without a GPU: the
interpreter that runs the kernels' other tests on the CPU does not refuse what the
compiler refuses (see tests/triton_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs triton (the test extra)")

ROOT = Path(__file__).resolve().parent.parent


def test_every_triton_kernel_compiles_for_the_gpus_it_serves_on():
    # A child process: this one may have imported triton with TRITON_INTERPRET=1, and
    # under the interpreter @triton.jit gives functions the compiler cannot take.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set, it warns no more
    result = subprocess.run([sys.executable, "-m", "tests.triton_compile"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=170)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, "\n".join(line for line in lines if line.startswith("FAIL")) or result.stderr[-3000:]
    # Three dtypes x (store, merge, rotary, decode and prefill attention with and without
    # window + soft-cap, prefill over blocks of 4 tokens, RMSNorm with and without the
    # residual, SiLU and GELU) x two GPUs.
    assert sum(line.startswith("ok ") for line in lines) == 3 * 12 * 2, result.stdout
