"""Which device the workers compute on, decided without importing torch.

The front end (supervisor, API servers, engine cores) never imports torch, yet it must
fix the device before it sizes the KV pool and picks the TP communicator, so that every
worker of every engine gets the same answer. It asks the CUDA driver directly
(``libcuda``'s ``cuInit`` and ``cuDeviceGetCount``, through ``ctypes``), which honours
``CUDA_VISIBLE_DEVICES`` as torch does. ``cuInit`` creates no context and allocates no
device memory; the processes that use a GPU are the workers, started with ``spawn``.
"""

from __future__ import annotations

import ctypes
import os

from aserve.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def cuda_device_count() -> int:
    """GPUs the CUDA driver shows this process (0 without a driver, or on any error)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    try:
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:
        return 0
    return count.value


def resolve_device(requested: str, gpus: int) -> str:
    """``cuda`` or ``cpu``: ``auto`` takes CUDA when ``gpus`` (visible GPUs) > 0, as vLLM
    does. Raises ``ConfigError`` for ``cuda`` without a GPU."""
    if requested == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if requested == "cuda" and gpus == 0:
        raise ConfigError("device='cuda' but no CUDA device is visible (no driver, or CUDA_VISIBLE_DEVICES hides them)",
                          param="device")
    return requested


def resolve_tp_comm(requested: str, device: str, *, tp_spans_nodes: bool = False) -> str:
    """The TP communicator for ``device``: ``auto`` is shared memory on CPU and NCCL on
    CUDA; gloo on CPU when a TP group spans machines (``tp_spans_nodes``: shared memory
    cannot). gloo works on both (on CUDA it copies through host memory: for tests and
    for ranks that share one GPU, which NCCL refuses). Raises ``ConfigError`` for shared
    memory on CUDA or across machines, or NCCL on CPU."""
    if requested == "auto":
        return "nccl" if device == "cuda" else "gloo" if tp_spans_nodes else "shm"
    if (requested == "shm" and device != "cpu") or (requested == "nccl" and device != "cuda"):
        raise ConfigError(f"tp_comm={requested!r} does not work on device {device!r}", param="tp_comm")
    if requested == "shm" and tp_spans_nodes:
        raise ConfigError("tp_comm='shm' needs each TP group on one machine; with these nnodes a group spans "
                          "machines (use gloo, or a pipeline stage per machine)", param="tp_comm")
    return requested


def worker_device_index(local_worker: int, gpus: int) -> int:
    """The GPU of local worker ``local_worker`` (engine ``k // tp``, rank ``k % tp``):
    one GPU each while there are enough; beyond that they wrap round and share."""
    return local_worker % gpus
