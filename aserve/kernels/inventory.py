"""Which of aserve's CPU kernels this CPU runs, and in which form: one line, printed by
``.ci/run`` before the tests (``python -m aserve.kernels.inventory``) so a CI log says what
the suite could test on the machine it ran on. The choice of which kernel serves a layer
is made where it is used and logged once by each worker at start-up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from aserve.kernels.cbuild import cpu_flags

#: The instruction-set flags the kernels' choices read.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile",
                "amx_bf16", "amx_int8")


def describe(flags: frozenset[str] | None = None, model: str | None = None) -> str:
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return "CPU: flags unreadable (not x86 Linux): the C kernels' portable paths only"
    have = [f for f in KERNEL_FLAGS if f in flags]
    if shutil.which(os.environ.get("CC", "gcc")) is None and shutil.which("cc") is None:
        return f"CPU flags: {' '.join(have)}; no C compiler: the kernels cannot be built, torch paths only"
    kernels = ["decode attention", "RMSNorm/SiLU/rotary", "token masks", "shared-memory collectives"]
    if {"avx2", "fma"} <= flags:
        form = "AVX-512 and AVX2 forms" if "avx512f" in flags else "AVX2 form"
        kernels.append(f"float32 linear, prefill attention + float32 one-call decode ({form})")
    else:
        kernels.append("no float32 linear or prefill attention kernel (needs AVX2 and FMA)")
    if {"avx512f", "avx512_bf16"} <= flags:
        kernels.append("AVX512-BF16 bf16 linear, prefill attention + its one-call decode, decode shared prefix")
    else:
        kernels.append("no AVX512-BF16 kernels (needs avx512f and avx512_bf16)")
    if {"amx_tile", "amx_bf16"} <= flags:
        kernels.append("AMX bf16 linear (with the gated MLP fused for long prefills), prefill attention, one-call decode "
                       "and decode shared prefix")
    else:
        kernels.append("no AMX kernels (needs amx_tile and amx_bf16)")
    if model is None:
        try:
            model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
        except (OSError, StopIteration):
            model = "unknown"
    return f"CPU: {model}; flags: {' '.join(have) or 'none of ' + '/'.join(KERNEL_FLAGS)}; kernels testable here: " + \
        "; ".join(kernels)


if __name__ == "__main__":
    print(describe())
