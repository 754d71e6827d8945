#!/usr/bin/env bash
# Downloads into .whl/ the wheels of aserve's dependencies that the lent GPU machine lacks
# (it has torch with triton, numpy, transformers and pytest; Python 3.12, x86-64 Linux, no
# network), for scripts/cuda_check.sh to install there. Run here, then pass
# carry=[".whl"] to the device run. About 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# --no-deps, every package named: what the machine has (transformers' tokenizers and
# safetensors, pytest, huggingface_hub) must not be replaced by newer versions.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp -d .whl \
    msgspec pyzmq setproctitle prometheus-client llguidance pytest-timeout \
    starlette anyio sniffio idna typing_extensions \
    hypercorn h11 h2 hpack hyperframe priority wsproto \
    trio outcome sortedcontainers attrs \
    aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl \
    httpx httpcore certifi
du -sh .whl
