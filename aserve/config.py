"""Engine configuration: frozen, split by component, validated once.

``EngineConfig`` is built once, from ``EngineArgs`` (``aserve.engine.args``: the CLI's
flags and the keyword arguments of ``LLM(...)`` and ``AsyncLLM(...)``), and handed to
every component, which reads only its own part. Values that depend on the model (the
fitted ``max_model_len``, the number of KV blocks, ``auto``'s device and dtypes) are
filled in once by ``aserve.engine.fit.fit_config`` through :meth:`EngineConfig.fitted`,
which returns a new object rather than mutating this one; every process is given the
fitted config and none fits it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aserve.devices import DEVICES
from aserve.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")

# vLLM's CPU backend reserves 4 GiB for the KV cache by default
# (VLLM_CPU_KVCACHE_SPACE); the pool is allocated untouched, so pages that no request
# ever used cost no resident memory.
DEFAULT_CPU_KV_CACHE_MEMORY = 4 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str  # path of a Hugging Face-format directory
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's limit, fitted to the KV cache
    seed: int = 0
    # Where the workers compute: "cpu", "cuda", or "auto" (CUDA when a GPU is visible;
    # resolved by fitting, aserve/devices.py).
    device: str = "auto"
    # CUDA graphs for decode steps on a GPU (aserve/worker/cuda_graphs.py): off with
    # enforce_eager; batches of up to max_cudagraph_capture_size rows (None: max_num_seqs,
    # at most 256) are captured.
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ConfigError("max_cudagraph_capture_size must be >= 1", param="max_cudagraph_capture_size")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}", param="dtype")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}", param="device")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}", param="max_model_len")


#: Default share of the KV pool that freed, cached blocks may fill before a block never
#: used yet is handed out (see ``aserve/engine/kv_cache_manager.py``).
DEFAULT_PREFIX_CACHE_RESERVE = 0.25


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = DEFAULT_CPU_KV_CACHE_MEMORY  # bytes, over all layers and ranks
    enable_prefix_caching: bool = True
    # While the pool has blocks never used yet, freed cached blocks are kept up to this
    # share of it; beyond, the oldest is evicted rather than a new block's pages touched.
    prefix_cache_reserve: float = DEFAULT_PREFIX_CACHE_RESERVE
    num_blocks: int | None = None  # set by fitting: usable blocks in the pool
    # The dtype keys and values are stored in ("auto": the model's, resolved by fitting).
    # A bf16 cache under a float32 model halves the bytes each decode step reads, and
    # the memory per token (vLLM's --kv-cache-dtype); attention still computes in the
    # model's dtype, over the stored (rounded) keys and values.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(DTYPES)}, got {self.kv_cache_dtype!r}"
                              + (" (no fp8 KV cache on CPU)" if self.kv_cache_dtype.startswith("fp8") else ""),
                              param="kv_cache_dtype")
        if not 0.0 <= self.prefix_cache_reserve <= 1.0:
            raise ConfigError(f"prefix_cache_reserve must be in [0, 1], got {self.prefix_cache_reserve}",
                              param="prefix_cache_reserve")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}", param="block_size")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}", param="kv_cache_memory")


#: Default token budget of one step, per tensor-parallel rank, for a server (``aserve
#: run``), by device. A server keeps steps short, so running streams keep flowing and a
#: burst of prompts is prefilled over several steps whose first requests answer sooner.
#: On CUDA, 2,048 (vLLM's server default on most GPUs). On a CPU, 1,024, half vLLM's CPU
#: default: a step of 2,048 prompt tokens of a 152M model takes 1.5-2 s on a two-thread
#: CPU, and every stream waits for it. Measured against 2,048 (docs/performance.md,
#: "The step budget on CPU"): median TTFT at 128 streams 0.31-0.33 against 0.53-0.61 s
#: (7M model), 2.7 against 5.0 s (152M), throughput the same within noise.
SERVER_MAX_NUM_BATCHED_TOKENS_PER_RANK = {"cpu": 1024, "cuda": 2048}
#: The library (``LLM``, ``AsyncLLM``) favours throughput, on either device.
LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK  # token budget of one step
    max_num_seqs: int = 256  # requests in one step
    enable_chunked_prefill: bool = True
    # A prompt longer than this is prefilled in chunks of at most this many tokens
    # per step even when the budget has room, so running requests keep streaming.
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1", param="max_num_batched_tokens")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1", param="max_num_seqs")


TP_COMMS = ("auto", "shm", "gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism inside each engine; data parallelism across engines.

    Each of the ``data_parallel_size`` engines of a dense model is independent (DP size 1
    inside it); ``data_parallel_size_local`` of them run on this node (default: all).
    An engine has ``pipeline_parallel_size`` stages of ``tensor_parallel_size`` workers:
    worker ``r`` of an engine is stage ``r // tp``, TP rank ``r % tp``
    (``aserve/model/pipeline.py``).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Layers of each stage (None: even, aserve.model.pipeline.stage_layers).
    pp_layer_partition: tuple[int, ...] | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    worker_threads: int | None = None  # torch threads per worker; None: cores / local world size
    # The cores of this node aserve may use (the starting process's affinity; None: all
    # of os.cpu_count()), and whether to pin processes to them (see cpu_plan).
    node_cpus: tuple[int, ...] | None = None
    cpu_affinity: bool = True
    # How the workers of one engine exchange activations: "shm" (CPU: shared memory;
    # gloo only sets it up and is then released), "nccl" (CUDA), "gloo" (either: every
    # collective over gloo's TCP), or "auto" (shm on CPU, NCCL on CUDA; resolved by
    # fitting, aserve/devices.py).
    tp_comm: str = "auto"
    # One engine across machines (docs/parallelism.md, "One engine across machines"): the
    # engine's workers split evenly over ``nnodes`` nodes, node ``node_rank`` running
    # workers node_rank * W / nnodes onwards; rank 0's node (the head) also runs the
    # engine core and the API servers. ``master_addr:master_port`` is the head's
    # torch.distributed rendezvous (a TCPStore); the two ports after it carry the
    # engine core's calls to remote workers and their replies (ZeroMQ, CURVE).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes), got node_rank={self.node_rank} with "
                              f"nnodes={self.nnodes}", param="node_rank")
        if self.nnodes > 1 and self.world_size % self.nnodes:
            raise ConfigError(f"the engine's {self.world_size} workers (tensor x pipeline parallel size) must split "
                              f"evenly over nnodes={self.nnodes}", param="nnodes")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ConfigError("an engine across nodes (nnodes > 1) serves one engine: data_parallel_size must be 1 "
                              "(data parallelism across nodes is --headless with --dp-size-local)", param="nnodes")
        if not 0 < self.master_port < 65534:
            raise ConfigError(f"master_port must leave two ports after it, got {self.master_port}",
                              param="master_port")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size must be >= 1", param="tensor_parallel_size")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("pipeline_parallel_size must be >= 1", param="pipeline_parallel_size")
        if self.pp_layer_partition is not None and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ConfigError(f"pp_layer_partition gives {len(self.pp_layer_partition)} stages but "
                              f"pipeline_parallel_size is {self.pipeline_parallel_size}", param="pp_layer_partition")
        if self.data_parallel_size < 1:
            raise ConfigError("data_parallel_size must be >= 1", param="data_parallel_size")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise ConfigError("data_parallel_size_local must be in [0, data_parallel_size]",
                              param="data_parallel_size_local")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ConfigError("worker_threads must be >= 1", param="worker_threads")
        if self.tp_comm not in TP_COMMS:
            raise ConfigError(f"tp_comm must be one of {', '.join(TP_COMMS)}, not {self.tp_comm!r}", param="tp_comm")

    @property
    def local_engines(self) -> int:
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def world_size(self) -> int:
        """Worker processes of one engine: its stages times its TP ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The worker that replies with an engine's step outputs: the first TP rank of the
        last stage (where the sampling happens)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def workers_per_node(self) -> int:
        """An engine's workers on each of its nodes (all of them with one node)."""
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks of the engine's workers this node runs."""
        return range(self.node_rank * self.workers_per_node, (self.node_rank + 1) * self.workers_per_node)

    @property
    def local_world_size(self) -> int:
        """Worker processes on this node: they share its cores."""
        return max(1, self.local_engines) * self.workers_per_node

    def threads_per_worker(self, cores: int) -> int:
        """``worker_threads``, or the node's cores shared out between its workers
        (``cores`` is used only when ``node_cpus`` is unknown)."""
        if self.node_cpus is not None:
            cores = len(self.node_cpus)
        return self.worker_threads or max(1, cores // self.local_world_size)

    def cpu_plan(self) -> tuple[tuple[int, ...], list[tuple[int, ...]]] | None:
        """``(front-end cores, cores of each local worker)``, or None: no pinning.

        When the workers' threads leave at least one core of ``node_cpus`` free, each
        worker gets cores of its own, from the end of the list, and the processes that
        serve them (engine cores, API servers, the coordinator) get the rest: a model
        step then never shares its cores with HTTP and scheduling work (vLLM binds its
        CPU workers' threads to cores for the same reason). Otherwise (the usual case of
        workers that use every core) nothing is pinned: the OS balances better than a
        fixed split of too few cores. Worker ``k`` is local engine ``k // world``, rank
        ``k % world`` (world: ``world_size``)."""
        cpus = self.node_cpus
        if not self.cpu_affinity or cpus is None:
            return None
        per_worker = self.threads_per_worker(len(cpus))
        used = per_worker * self.local_world_size
        if used >= len(cpus):
            return None
        end = len(cpus)
        workers = [tuple(cpus[end - (k + 1) * per_worker : end - k * per_worker]) for k in range(self.local_world_size)]
        return tuple(cpus[: end - used]), workers

    def frontend_cpus(self) -> tuple[int, ...] | None:
        """The cores of engine cores and API servers under :meth:`cpu_plan` (None: any)."""
        plan = self.cpu_plan()
        return None if plan is None else plan[0]

    def worker_cpus(self, dp_rank: int, rank: int) -> tuple[int, ...] | None:
        """The cores of worker ``rank`` of DP engine ``dp_rank`` (None: any); a node's
        engines are consecutive DP ranks."""
        plan = self.cpu_plan()
        if plan is None:
            return None
        return plan[1][self.local_worker_index(dp_rank, rank)]

    def local_worker_index(self, dp_rank: int, rank: int) -> int:
        """Which of this node's workers worker ``rank`` of DP engine ``dp_rank`` is (its
        cores, its GPU); a node's engines are consecutive DP ranks."""
        return (dp_rank % max(1, self.local_engines)) * self.workers_per_node + rank % self.workers_per_node


#: Seconds without a heartbeat after which an engine core or worker counts as dead (each
#: ticks once a second from a thread of its own, so a stopped one is seen within ~5 s).
DEFAULT_HEARTBEAT_TIMEOUT = 4.0
#: The least time a step may take before it counts as hung, when no
#: ``execute_model_timeout`` is set (the bound grows with the longest step measured).
STEP_TIMEOUT_FLOOR = 60.0
#: ... and how many times the longest step measured so far a step may take.
STEP_TIMEOUT_FACTOR = 10.0
#: Seconds the front end waits for every engine's READY (weights load in this time).
DEFAULT_STARTUP_TIMEOUT = 600.0


@dataclass(frozen=True)
class HealthConfig:
    """When whoever watches the engine processes gives up on one: it stopped ticking its
    heartbeat (``aserve.process.heartbeat``: the process is stopped or frozen), a step
    made no progress for ``execute_model_timeout`` (None: ``STEP_TIMEOUT_FACTOR`` times
    the longest step measured, at least ``STEP_TIMEOUT_FLOOR``; a deadlock inside a
    process that still ticks), or it never became ready."""

    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    execute_model_timeout: float | None = None

    def step_bound(self, longest_step: float) -> float:
        """Seconds a step may be in flight before the engine counts as hung."""
        if self.execute_model_timeout is not None:
            return self.execute_model_timeout
        return max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_FACTOR * longest_step)

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout", "startup_timeout", "execute_model_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}", param=name)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    health: HealthConfig = HealthConfig()

    def fitted(self, *, max_model_len: int, num_blocks: int, dtype: str | None = None,
               kv_cache_dtype: str | None = None, device: str | None = None,
               tp_comm: str | None = None) -> EngineConfig:
        """This config with the values that start-up measured filled in (and ``auto``'s
        dtypes, device and TP communicator resolved, when given)."""
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, max_model_len=max_model_len, dtype=dtype or self.model.dtype,
                                      device=device or self.model.device),
            cache=dataclasses.replace(self.cache, num_blocks=num_blocks,
                                      kv_cache_dtype=kv_cache_dtype or self.cache.kv_cache_dtype),
            parallel=dataclasses.replace(self.parallel, tp_comm=tp_comm or self.parallel.tp_comm),
        )

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is None:
            raise RuntimeError("max_model_len is known only after fitting (aserve.engine.fit.fit_config)")
        return self.model.max_model_len
