"""The few environment variables aserve reads, typed, in one place.

===========================  ===================================================  =======================
variable                     meaning                                              default
===========================  ===================================================  =======================
``ASERVE_CACHE_DIR``         where the default model and C kernels are built      ``~/.cache/aserve``
``ASERVE_LOG_LEVEL``         log level of aserve's loggers                        ``INFO``
``ASERVE_CPU_ATTENTION``     ``sdpa``: no C attention kernels (decode, prefill)   ``kernel``
``ASERVE_CPU_FUSED_OPS``     ``0``: no C RMSNorm / SiLU / rotary / token-mask     ``1``
``ASERVE_CPU_AMX``           ``0``: no AMX kernels (bf16 linear layers then take  ``1``
                             the AVX512-BF16 kernel where the CPU has it)
``ASERVE_CPU_BF16_LINEAR``   ``0``: no AVX512-BF16 linear kernel (oneDNN)         ``1``
``ASERVE_CPU_F32_LINEAR``    ``0``: float32 linear layers on oneDNN and MKL       ``1``
``ASERVE_CPU_FUSED_DECODE``  ``0``: decode steps call each layer's kernels apart  ``1``
``ASERVE_CPU_DECODE_PREFIX`` ``0``: decode rows attend over a shared prefix one  ``1``
                             by one, not together as matrix products (AMX
                             tiles, or AVX512-BF16 without AMX)
``ASERVE_DP_SECRET``         shared secret of a multi-node server's TCP wires     none (``--dp-secret``)
``ASERVE_TRITON``            ``auto``: the Triton kernels on a GPU; ``1``: also   ``auto``
                             on CPU tensors (needs ``TRITON_INTERPRET=1``: tests);
                             ``0``: never
===========================  ===================================================  =======================

Read them through :func:`read_env`, once, at the edge (the CLI or a constructor), and
pass the values on explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Env:
    cache_dir: Path
    log_level: str
    dp_secret: str | None = None
    cpu_attention: str = "kernel"
    cpu_fused_ops: bool = True
    cpu_amx: bool = True
    cpu_bf16_linear: bool = True
    cpu_fused_decode: bool = True
    cpu_f32_linear: bool = True
    cpu_decode_prefix: bool = True
    triton: str = "auto"  # auto | on | off


def read_env(environ: dict[str, str] | None = None) -> Env:
    environ = dict(os.environ) if environ is None else environ
    default_cache = Path(environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aserve"
    return Env(
        cache_dir=Path(environ.get("ASERVE_CACHE_DIR", default_cache)).expanduser(),
        log_level=environ.get("ASERVE_LOG_LEVEL", "INFO").upper(),
        dp_secret=environ.get("ASERVE_DP_SECRET") or None,
        cpu_attention=environ.get("ASERVE_CPU_ATTENTION", "kernel").lower(),
        cpu_fused_ops=environ.get("ASERVE_CPU_FUSED_OPS", "1").lower() not in ("0", "false", "no", "off"),
        cpu_amx=environ.get("ASERVE_CPU_AMX", "1").lower() not in ("0", "false", "no", "off"),
        cpu_bf16_linear=environ.get("ASERVE_CPU_BF16_LINEAR", "1").lower() not in ("0", "false", "no", "off"),
        cpu_fused_decode=environ.get("ASERVE_CPU_FUSED_DECODE", "1").lower() not in ("0", "false", "no", "off"),
        cpu_f32_linear=environ.get("ASERVE_CPU_F32_LINEAR", "1").lower() not in ("0", "false", "no", "off"),
        cpu_decode_prefix=environ.get("ASERVE_CPU_DECODE_PREFIX", "1").lower() not in ("0", "false", "no", "off"),
        triton={"0": "off", "false": "off", "no": "off", "off": "off", "1": "on", "true": "on", "yes": "on",
                "on": "on"}.get(environ.get("ASERVE_TRITON", "auto").lower(), "auto"),
    )
