"""The CPU kernels' shared-out work (``work_next`` in aserve/kernels/cpu_kernels.h):
every item is computed once whichever thread takes it, including when OpenMP gives a
region fewer threads than the kernel split the work for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aserve.kernels import amx_linear, bf16_linear, cpu_decode_attention

# Computes each kernel's output at the thread count in argv[1] and prints one digest per
# output. Inputs come from fixed seeds, so runs in separate processes agree.
SCRIPT = r'''
import hashlib, sys, torch
from aserve.kernels import bf16_linear, cpu_decode_attention
import os
torch.set_num_threads(int(sys.argv[1]))
print("threads before", len(os.listdir("/proc/self/task")))
def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
g = torch.Generator().manual_seed(0)
amx = bf16_linear.load_best()  # AMX, else AVX512-BF16: the same work sharing
w = (torch.randn(1024, 256, generator=g) * 0.1).bfloat16()
packed = amx.pack(w)
for rows in (32, 100):  # a decode batch (items of one pair), a prefill (groups of pairs)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    print("linear", rows, digest(amx.linear(x, packed, 1024)))
attend = cpu_decode_attention.load()
B, Hq, Hk, D, bs = 12, 8, 4, 64, 16
# Skewed lengths: the first threads' ranges hold the long sequences, so the others run
# out early and take from them.
lens = torch.tensor([300] * 4 + [17] * 8)
max_blocks = 19
cache = torch.randn(2, B * max_blocks + 1, bs, Hk, D, generator=g).bfloat16()
table = (torch.randperm(B * max_blocks, generator=g) + 1).view(B, max_blocks)
q = torch.randn(B, Hq, D, generator=g).bfloat16()
print("attention", digest(attend(q, cache[0], cache[1], table, lens, 0.125)))
print("threads after", len(os.listdir("/proc/self/task")))
'''


def run(threads: int, **env: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    return {" ".join(parts[:-1]): parts[-1] for parts in lines}


@pytest.mark.skipif(not (amx_linear.cpu_has_amx() or bf16_linear.cpu_supported()),
                    reason="this CPU has neither AMX nor AVX512-BF16: no bf16 linear kernel runs on it")
def test_outputs_do_not_depend_on_how_threads_share_the_work():
    assert cpu_decode_attention.load() is not None
    one = run(1)
    three = run(3)
    # OpenMP capped at one thread while the kernels split for three: the one thread
    # must take the two missing threads' ranges too.
    capped = run(3, OMP_THREAD_LIMIT="1")
    keys = ["linear 32", "linear 100", "attention"]
    assert [three[k] for k in keys] == [one[k] for k in keys]
    assert [capped[k] for k in keys] == [one[k] for k in keys]
    # The cap held: the kernels' regions started no OpenMP threads (so the missing
    # ranges were really taken by the one thread), where uncapped they started two.
    assert int(capped["threads after"]) == int(capped["threads before"])
    assert int(three["threads after"]) == int(three["threads before"]) + 2
