"""From the keyword arguments users pass (``LLM(...)``, ``AsyncLLM(...)``, CLI flags) to
one validated ``EngineConfig``."""

from __future__ import annotations

import os

from aserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_PREFIX_CACHE_RESERVE,
    LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from aserve.envs import read_env
from aserve.model_builder import ensure_default_model


def resolve_model_path(model: str | None) -> str:
    """The model directory; the embedded default model (built on first use) when None."""
    if model is None:
        return str(ensure_default_model(read_env().cache_dir))
    return model


def node_cpus() -> tuple[int, ...] | None:
    """The cores this process may run on (the node's share for aserve's processes)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return None


def make_engine_config(
    model: str | None = None,
    *,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    data_parallel_size_local: int | None = None,
    worker_threads: int | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    kv_cache_memory: int = DEFAULT_CPU_KV_CACHE_MEMORY,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    prefix_cache_reserve: float = DEFAULT_PREFIX_CACHE_RESERVE,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int | None = None,
    cpu_affinity: bool = True,
    tp_comm: str = "auto",
    kv_cache_dtype: str = "auto",
    device: str = "auto",
) -> EngineConfig:
    """Raises ``ConfigError`` (naming the field) for an invalid value.

    ``max_num_batched_tokens`` defaults to the library's budget times the TP size
    (``LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK``; ``aserve run`` passes the server's)."""
    if max_num_batched_tokens is None:
        max_num_batched_tokens = LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK * tensor_parallel_size
    return EngineConfig(
        model=ModelConfig(resolve_model_path(model), dtype=dtype, max_model_len=max_model_len, seed=seed,
                          device=device),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                          enable_prefix_caching=enable_prefix_caching, prefix_cache_reserve=prefix_cache_reserve,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill, long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                                data_parallel_size_local=data_parallel_size_local, worker_threads=worker_threads,
                                node_cpus=node_cpus(), cpu_affinity=cpu_affinity, tp_comm=tp_comm),
    )
