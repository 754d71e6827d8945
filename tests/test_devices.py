"""Choosing the device and the TP communicator, before any worker starts (no GPU needed:
the GPU count is the driver's answer, replaced here where a test needs another)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aserve.cli import build_parser
from aserve.config import ModelConfig
from aserve.devices import cuda_device_count, resolve_device, resolve_tp_comm, worker_device_index
from aserve.engine import fit as engine_fit
from aserve.engine.fit import fit_config
from aserve.errors import ConfigError
from aserve.engine.args import EngineArgs


def test_auto_takes_cuda_only_when_a_gpu_is_visible():
    assert resolve_device("auto", 0) == "cpu"
    assert resolve_device("auto", 2) == "cuda"
    assert resolve_device("cpu", 2) == "cpu"
    assert resolve_device("cuda", 1) == "cuda"
    with pytest.raises(ConfigError, match="no CUDA device is visible") as info:
        resolve_device("cuda", 0)
    assert info.value.param == "device"
    with pytest.raises(ConfigError, match="device must be one of") as info:
        ModelConfig("m", device="tpu")
    assert info.value.param == "device"


def test_tp_comm_follows_the_device_and_refuses_a_mismatch():
    assert resolve_tp_comm("auto", "cpu") == "shm"
    assert resolve_tp_comm("auto", "cuda") == "nccl"
    assert resolve_tp_comm("gloo", "cpu") == resolve_tp_comm("gloo", "cuda") == "gloo"
    for comm, device in (("shm", "cuda"), ("nccl", "cpu")):
        with pytest.raises(ConfigError, match="does not work on device") as info:
            resolve_tp_comm(comm, device)
        assert info.value.param == "tp_comm"


def test_workers_take_a_gpu_each_then_share():
    assert [worker_device_index(k, 2) for k in range(4)] == [0, 1, 0, 1]
    assert [worker_device_index(k, 1) for k in range(3)] == [0, 0, 0]


def test_the_driver_count_agrees_with_torch_and_honours_cuda_visible_devices():
    import torch

    assert cuda_device_count() == torch.cuda.device_count()
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, in a fresh process as torch reads it.
    code = "from aserve.devices import cuda_device_count; print(cuda_device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.stdout.strip() == "0"


def _fit(monkeypatch, gpus: int, model_dir, **kwargs):
    monkeypatch.setattr(engine_fit, "cuda_device_count", lambda: gpus)
    return fit_config(EngineArgs(str(model_dir), kv_cache_memory=1 << 22, **kwargs).create_engine_config()).config


def test_fitting_resolves_the_device_communicator_and_dtype(monkeypatch, llama_dir, bf16_llama_dir):
    cpu = _fit(monkeypatch, 0, llama_dir, tensor_parallel_size=2)
    assert (cpu.model.device, cpu.parallel.tp_comm) == ("cpu", "shm")
    gpu = _fit(monkeypatch, 2, llama_dir, tensor_parallel_size=2)
    assert (gpu.model.device, gpu.parallel.tp_comm) == ("cuda", "nccl")
    forced_cpu = _fit(monkeypatch, 2, llama_dir, device="cpu")
    assert (forced_cpu.model.device, forced_cpu.parallel.tp_comm) == ("cpu", "shm")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        _fit(monkeypatch, 0, llama_dir, device="cuda")
    # NCCL refuses two ranks on one GPU: a clear error before any process starts, and
    # gloo as the way round it.
    with pytest.raises(ConfigError, match="needs a GPU per rank, and 1 are visible") as info:
        _fit(monkeypatch, 1, llama_dir, tensor_parallel_size=2)
    assert info.value.param == "tensor_parallel_size"
    assert _fit(monkeypatch, 1, llama_dir, tensor_parallel_size=2, tp_comm="gloo").parallel.tp_comm == "gloo"
    # A bf16 checkpoint stays bf16 on a GPU even where this CPU would compute in float32.
    monkeypatch.setattr(engine_fit, "cpu_half_dtypes", lambda: frozenset())
    assert _fit(monkeypatch, 1, bf16_llama_dir).model.dtype == "bfloat16"
    assert _fit(monkeypatch, 0, bf16_llama_dir).model.dtype == "float32"


def test_cli_flags():
    args = build_parser().parse_args(["run", "--device", "cuda", "--tp-comm", "nccl"])
    assert (args.device, args.tp_comm) == ("cuda", "nccl")
    assert build_parser().parse_args(["run"]).tp_comm == "auto"
    assert build_parser().parse_args(["generate", "hi", "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--device", "tpu"])
