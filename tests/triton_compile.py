"""Compiles every Triton kernel of aserve, ahead of time, to a GPU's machine code (PTX,
then ``ptxas`` to a cubin), with no GPU: Triton's compiler and ``ptxas`` come in its
wheel. The interpreter that runs the kernels' tests on the CPU does not check what the
compiler refuses (a global that is not a ``tl.constexpr``, a shape ``tl.dot`` cannot
take), so without this a kernel could pass every CPU test and fail on its first GPU.

Run as ``python -m tests.triton_compile`` with ``TRITON_INTERPRET`` unset (under the
interpreter ``@triton.jit`` gives functions the compiler cannot take); prints one line a
kernel variant and exits 1 if any fails. ``tests/test_triton_compile.py`` runs it.

Each variant names the argument types the serving path passes (tensors' dtypes, int64
slot and block ids, strides as i32) and the constexprs of one shape: the flags are
compiled both ways, the dtypes each that serves (float32, bfloat16, float16).
"""

from __future__ import annotations

import os
import sys
import time

# Hopper (the lent H200) and Ampere: the architectures Triton's tensor cores are
# compiled for differently.
TARGETS = [("cuda", 90, 32), ("cuda", 80, 32)]
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def variants() -> list[tuple[str, object, dict, dict]]:
    """``(name, kernel, signature, constexprs)`` for every variant to compile (the launch
    options a kernel is launched with: :func:`launch_options`)."""
    from aserve.kernels import triton_attention as ta
    from aserve.kernels import triton_ops as to

    out = []
    for dtype, t in DTYPES.items():
        p = f"*{t}"
        out.append((f"store_kv {dtype}", ta._store_kv_kernel,
                    dict(k_ptr=p, v_ptr=p, cache_ptr=p, slots_ptr="*i64", stride_kt="i32", stride_vt="i32",
                         stride_side="i32", stride_slot="i32"), dict(WIDTH=256, BLOCK=256)))
        for window, softcap in ((False, False), (True, True)):
            flags = dict(HAS_WINDOW=window, HAS_SOFTCAP=softcap)
            tag = f"{dtype} window={window} softcap={softcap}"
            out.append((f"decode_part {tag}", ta._decode_part_kernel,
                        dict(q_ptr=p, cache_ptr=p, table_ptr="*i64", lens_ptr="*i64", part_ml_ptr="*fp32",
                             part_acc_ptr="*fp32", scale="fp32", window="i32", softcap="fp32", stride_qn="i32",
                             stride_qh="i32", stride_side="i32", stride_block="i32", stride_tok="i32",
                             stride_head="i32", stride_tn="i32", num_splits="i32", num_heads="i32"),
                        dict(GROUP=4, BS=16, D=64, BLOCK_D=64, BLOCK_N=64, **flags)))
            out.append((f"prefill {tag}", ta._prefill_kernel,
                        dict(q_ptr=p, cache_ptr=p, table_ptr="*i64", starts_ptr="*i64", lens_ptr="*i64",
                             ctx_ptr="*i64", out_ptr=p, scale="fp32", window="i32", softcap="fp32", stride_qt="i32",
                             stride_qh="i32", stride_side="i32", stride_block="i32", stride_tok="i32",
                             stride_head="i32", stride_tc="i32", stride_ot="i32", stride_oh="i32"),
                        dict(GROUP=4, BS=16, D=64, BLOCK_D=64, BLOCK_M=16, BLOCK_N=16, **flags)))
        # Blocks of 4 tokens and heads of 8 dims (the tests' small models): below what
        # tl.dot takes, so the kernel reads 16 keys an iteration and pads the head to 16.
        out.append((f"prefill {dtype} block_size=4 head_dim=8", ta._prefill_kernel, out[-1][2],
                    dict(GROUP=4, BS=4, D=8, BLOCK_D=16, BLOCK_M=16, BLOCK_N=16, HAS_WINDOW=False,
                         HAS_SOFTCAP=False)))
        out.append((f"decode_merge {dtype}", ta._decode_merge_kernel,
                    dict(part_ml_ptr="*fp32", part_acc_ptr="*fp32", out_ptr=p, stride_on="i32", stride_oh="i32",
                         num_splits="i32", num_heads="i32"), dict(D=64, BLOCK_D=64, SPLITS=4)))
        for has_res in (False, True):
            out.append((f"rms_norm {dtype} residual={has_res}", to._rms_kernel,
                        dict(x_ptr=p, res_ptr=p, res_out_ptr=p, w_ptr=p, out_ptr=p, stride_x="i32", stride_r="i32",
                             stride_ro="i32", stride_o="i32", n="i32", eps="fp32"),
                        dict(HAS_RES=has_res, BLOCK=1024)))
        for gelu in (False, True):
            out.append((f"gated {dtype} gelu={gelu}", to._gated_kernel,
                        dict(gu_ptr=p, out_ptr=p, stride_in="i32", stride_out="i32", inter="i32"),
                        dict(GELU=gelu, BLOCK=1024)))
        out.append((f"rotary {dtype}", to._rotary_kernel,
                    dict(x_ptr=p, cos_ptr=p, sin_ptr=p, stride_t="i32", stride_h="i32", stride_c="i32", half="i32"),
                    dict(BLOCK=32)))
    return out


def launch_options(kernel) -> dict:
    """The options aserve launches ``kernel`` with (its warps where not Triton's default)."""
    from aserve.kernels import triton_attention as ta

    return {"num_warps": ta.DECODE_WARPS} if kernel is ta._decode_part_kernel else {}


def compile_one(kernel, signature: dict, constexprs: dict, target: tuple) -> int:
    """Compiles one variant, with the options it is launched with; returns the cubin's size in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = set(kernel.arg_names) - set(signature) - set(constexprs)
    if missing:
        raise TypeError(f"no type given for {sorted(missing)}")
    full = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, full, constexprs=constexprs), target=GPUTarget(*target),
                              options=launch_options(kernel))
    return len(compiled.asm["cubin"])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the interpreter's functions cannot be compiled; unset it", file=sys.stderr)
        return 2
    failed = 0
    for name, kernel, signature, constexprs in variants():
        for target in TARGETS:
            start = time.perf_counter()
            try:
                size = compile_one(kernel, signature, constexprs, target)
            except Exception as exc:  # every failure is reported, then the exit status says so
                failed += 1
                first = str(exc).strip().splitlines()
                print(f"FAIL sm_{target[1]} {name}: {type(exc).__name__}: {' / '.join(first[-3:])}", flush=True)
                continue
            print(f"ok   sm_{target[1]} {name}: cubin {size} B, {time.perf_counter() - start:.2f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
