#!/usr/bin/env bash
# The CUDA path's checks, for a machine with a GPU: the GPU tests of
# tests/test_cuda.py, the Triton kernels compiled (tests/test_triton_kernels.py on CUDA
# tensors) and the device choice of tests/test_devices.py, plus NCCL on its own.
#
# Run from the repository root. Where aserve's dependencies are not installed (the lent
# GPU machine has torch, transformers and pytest but not msgspec, pyzmq, trio, ...),
# put their wheels in .whl/ (see docs/cuda.md) and this installs them under /tmp/site.
# Writes its logs to $OUT (default /tmp/aserve-cuda-check). Took ~4.5 minutes on the H200.
set -uo pipefail
OUT=${OUT:-/tmp/aserve-cuda-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi -L 2>&1 | tee "$OUT/gpus.txt"
$PY - <<'PY' 2>&1 | tee -a "$OUT/gpus.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())),
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
from aserve.devices import cuda_device_count
print("aserve.devices.cuda_device_count():", cuda_device_count())
PY

# NCCL alone: one rank per GPU all-reduces; then two ranks on GPU 0, which NCCL is
# expected to refuse (why TP = 2 over NCCL needs two GPUs).
# The probe's source goes to a temporary file, not $OUT: the device tool returns at most
# eight files from there, and the logs and cuda_bench.py's results are eight.
PROBE=$(mktemp --suffix=.py)
cat > "$PROBE" <<'PY'
import os, sys, tempfile
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def rank_main(rank, world, path, same_gpu, q):
    dev = torch.device("cuda", 0 if same_gpu else rank)
    try:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world, device_id=dev)
        x = torch.full((4,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        q.put((rank, "ok", x.tolist()))
        dist.destroy_process_group()
    except Exception as exc:
        q.put((rank, "error", f"{type(exc).__name__}: {str(exc).splitlines()[0]} / {str(exc)[-300:]}"))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    gpus = torch.cuda.device_count()
    cases = [("one rank per GPU", min(gpus, 2), False), ("two ranks on GPU 0", 2, True)]
    for name, world, same in cases:
        q = ctx.Queue()
        path = tempfile.mktemp()
        procs = [ctx.Process(target=rank_main, args=(r, world, path, same, q)) for r in range(world)]
        for p in procs: p.start()
        results = []
        for _ in procs:
            try:
                results.append(q.get(timeout=60))
            except Exception:
                results.append(("?", "timeout", ""))
        for p in procs:
            p.join(10)
            if p.is_alive(): p.kill()
        print(f"NCCL, {name} (world {world}):", sorted(results, key=str))
PY
timeout 240 $PY "$PROBE" 2>&1 | grep -v "^\s*$" | tail -20 | tee "$OUT/nccl.txt"

# -W default: warnings are shown, not errors, so that a warning of this machine's torch
# build does not hide what the tests found.
timeout 300 $PY -m pytest -q -ra -p no:cacheprovider -W default tests/test_devices.py tests/test_cuda.py \
    tests/test_triton_kernels.py 2>&1 \
    | tee "$OUT/pytest.txt"
status=${PIPESTATUS[0]}

# The CPU suite's correctness tests against transformers, unchanged: on this machine
# device="auto" resolves to CUDA, so they run on the GPU. TP = 2 is left out (NCCL needs
# two GPUs; the gloo form is in tests/test_cuda.py), and so is the test of the CPU's
# shared-memory communicator.
timeout 200 $PY -m pytest -q -ra -p no:cacheprovider -W default tests/test_hf_parity.py tests/test_sampling.py \
    -k "not tensor_parallel and not tp_comms" 2>&1 | tee "$OUT/pytest-auto.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# Speed against the HBM floor (scripts/cuda_bench.py): the 152M benchmark model and a
# ~1B one made there, bf16, decode steps at batch 1 and 32 with CUDA graphs and eager,
# the graphs' tokens against the eager ones, the 152M model served at 32 streams, and a
# profile of its batch-32 step (the GPU's share of it, the costliest kernels: "PROFILE"
# lines). One "CHECK" line per figure.
if [ "${SKIP_SPEED:-0}" != 1 ]; then
    timeout 300 $PY scripts/cuda_bench.py --models 152m,1b --batches 1,32 --serve --profile --out "$OUT" 2>&1 \
        | tee "$OUT/speed.txt" | grep "^CHECK"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
echo "== summary =="
grep -h "passed\|failed\|^CHECK" "$OUT/pytest.txt" "$OUT/pytest-auto.txt" "$OUT/speed.txt" 2>/dev/null | grep -v "^\s*$"
exit "$status"
