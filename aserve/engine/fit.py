"""Fitting an ``EngineConfig`` to its model: everything that can be known before any
process starts.

:func:`fit_config` reads ``config.json`` and the checkpoint's headers (torch-free), checks
what the model and the flags must agree on (a supported architecture, heads that divide
over the TP size, an intact checkpoint, a ``max_model_len`` inside the model's limit and
the KV budget), resolves ``auto`` (device, TP communicator, dtypes) and sizes the KV
pool. Whoever starts an engine fits once and hands the fitted config to every process
it starts (``aserve run``: the supervisor; ``AsyncLLM`` and ``LLM``: their constructor;
a headless node: its own supervisor, with its own GPUs), so a bad setting or model file
is reported in the caller, as a typed error naming it, never by a child half-way up.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from aserve.config import EngineConfig
from aserve.devices import cuda_device_count, resolve_device, resolve_tp_comm
from aserve.errors import ConfigError, ModelFileNotFoundError
from aserve.model.checkpoint import check_checkpoint
from aserve.model.dtypes import cpu_half_dtypes, resolve_dtype_name
from aserve.model.hf_config import ArchConfig, load_arch_config
from aserve.model.kv_spec import bytes_per_block
from aserve.model.pipeline import stage_layers
from aserve.model.registry import check_architecture

logger = logging.getLogger("aserve.engine")


@dataclasses.dataclass(frozen=True)
class FittedConfig:
    config: EngineConfig  # with max_model_len and num_blocks filled in, auto resolved
    arch: ArchConfig

    @property
    def kv_capacity_tokens(self) -> int:
        assert self.config.cache.num_blocks is not None
        return (self.config.cache.num_blocks - 1) * self.config.cache.block_size


def fit_config(config: EngineConfig) -> FittedConfig:
    """Check ``config`` against its model, size the KV pool and fit ``max_model_len``.

    Raises ``ModelFileNotFoundError`` / ``CorruptModelFileError`` /
    ``UnsupportedArchitectureError`` for the model directory, ``ConfigError`` (naming the
    field) for a setting the model or the machine cannot take.
    """
    model_dir = Path(config.model.model)
    if not model_dir.is_dir():
        raise ModelFileNotFoundError(f"model directory {model_dir} does not exist: give a Hugging Face-format "
                                     "directory (config.json, *.safetensors, tokenizer.json)")
    arch = load_arch_config(model_dir)
    check_architecture(arch.architecture)  # fail early, naming the supported ones
    tp_size = config.parallel.tensor_parallel_size
    check_tp_divides(arch, tp_size)
    # Each stage's layers (ConfigError for a partition that cannot work); a rank's KV
    # pool holds its stage's layers, so the stage with the most sizes the blocks.
    stages = stage_layers(arch.num_hidden_layers, config.parallel.pipeline_parallel_size,
                          config.parallel.pp_layer_partition)
    stage_layers_max = max(end - start for start, end in stages)
    check_checkpoint(model_dir)
    # Resolved once, here, and passed on in the fitted config: the workers (and, with
    # --headless nodes, every node) then compute on the device, and in the dtype, the KV
    # cache was sized for.
    gpus = cuda_device_count() if config.model.device != "cpu" else 0
    device = resolve_device(config.model.device, gpus)
    parallel = config.parallel
    tp_comm = resolve_tp_comm(parallel.tp_comm, device,
                              tp_spans_nodes=parallel.nnodes > 1 and parallel.workers_per_node % tp_size != 0)
    world = config.parallel.world_size
    if tp_comm == "nccl" and parallel.workers_per_node > gpus:
        sizes = f"tensor_parallel_size={tp_size}" + (f" x pipeline_parallel_size={world // tp_size}"
                                                      if world > tp_size else "")
        raise ConfigError(f"{sizes} over NCCL needs a GPU per rank, and {gpus} are visible "
                          "(NCCL refuses two ranks on one GPU; tp_comm='gloo' lets them share)",
                          param="tensor_parallel_size")
    workers = config.parallel.local_world_size
    if device == "cuda" and workers > gpus:
        logger.warning("%d workers on %d GPU(s): they share them (aserve/devices.py), each with its own KV "
                       "pool of kv_cache_memory bytes", workers, gpus)
    # A GPU multiplies every dtype natively; only a CPU may lack half precision.
    dtype = resolve_dtype_name(config.model.dtype, arch, cpu_half_dtypes() if device == "cpu" else None)
    checkpoint = resolve_dtype_name("auto", arch)  # no CPU given: the checkpoint's own
    if config.model.dtype == "auto" and dtype != checkpoint:
        logger.warning("the checkpoint is %s but this CPU has no native %s matrix products: computing in float32 "
                       "(--dtype %s keeps it)", checkpoint, checkpoint, checkpoint)
    kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else config.cache.kv_cache_dtype
    block_size = config.cache.block_size
    per_block = bytes_per_block(arch, tp_size=tp_size, dtype=kv_dtype, block_size=block_size,
                                num_layers=stage_layers_max)
    num_blocks = config.cache.kv_cache_memory // per_block
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_memory={config.cache.kv_cache_memory} bytes is too small: one block of {block_size} tokens "
            f"takes {per_block} bytes and at least 2 are needed",
            param="kv_cache_memory",
        )
    capacity = (num_blocks - 1) * block_size
    limit = arch.max_position_embeddings
    requested = config.model.max_model_len
    if requested is None:
        max_model_len = min(limit, capacity)
    else:
        if requested > limit:
            raise ConfigError(
                f"max_model_len={requested} exceeds the model's limit of {limit} positions; lower it, or leave it "
                "unset for the model's limit", param="max_model_len"
            )
        if requested > capacity:
            raise ConfigError(
                f"max_model_len={requested} needs {-(-requested // block_size) * per_block + per_block} bytes of KV cache "
                f"but kv_cache_memory={config.cache.kv_cache_memory} holds only {capacity} tokens; raise "
                "kv_cache_memory or lower max_model_len",
                param="max_model_len",
            )
        max_model_len = requested
    return FittedConfig(config.fitted(max_model_len=max_model_len, num_blocks=num_blocks, dtype=dtype,
                                      kv_cache_dtype=kv_dtype, device=device, tp_comm=tp_comm), arch)


def check_tp_divides(arch: ArchConfig, tp_size: int) -> None:
    """The model's shapes must split over ``tp_size`` ranks (``aserve.model.layers.linear``):
    attention heads and the MLP's width evenly, KV heads evenly or replicated."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"tensor_parallel_size={tp_size} does not divide this model's {what}; choose a size "
                           "that does", param="tensor_parallel_size")

    if arch.num_attention_heads % tp_size:
        raise refuse(f"{arch.num_attention_heads} attention heads")
    kv = arch.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise refuse(f"{kv} key/value heads (nor is it a multiple of them)")
    if arch.intermediate_size % tp_size and (arch.moe is None or not all(arch.moe.sparse_layers)):
        raise refuse(f"MLP width of {arch.intermediate_size}")
    if arch.moe is not None:
        # Every rank holds a slice of every expert (aserve.model.layers.moe).
        if arch.moe.intermediate_size % tp_size:
            raise refuse(f"expert width of {arch.moe.intermediate_size}")
        if arch.moe.shared_expert_intermediate_size % tp_size:
            raise refuse(f"shared expert width of {arch.moe.shared_expert_intermediate_size}")
