"""The engine core's logic: a scheduler, a KV cache manager and an executor, stepped.

No sockets, no event loop: ``add_request``, ``abort_requests`` and ``step`` are plain
calls, so the offline ``LLM`` drives this object directly and the engine-core process
wraps it with its wires.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

from aserve.config import EngineConfig
from aserve.devices import cuda_device_count, resolve_device, resolve_tp_comm
from aserve.engine.kv_cache_manager import KVCacheManager
from aserve.engine.request import Request
from aserve.engine.scheduler import Scheduler
from aserve.errors import ConfigError, PromptTooLongError
from aserve.model.hf_config import ArchConfig, load_arch_config
from aserve.model.dtypes import cpu_half_dtypes, resolve_dtype_name
from aserve.model.registry import check_architecture
from aserve.wire.messages import EngineCoreOutput, EngineCoreRequest
from aserve.worker.kv_spec import bytes_per_block

logger = logging.getLogger("aserve.engine")


@dataclasses.dataclass(frozen=True)
class FittedConfig:
    config: EngineConfig  # with max_model_len and num_blocks filled in
    arch: ArchConfig

    @property
    def kv_capacity_tokens(self) -> int:
        assert self.config.cache.num_blocks is not None
        return (self.config.cache.num_blocks - 1) * self.config.cache.block_size


def fit_config(config: EngineConfig) -> FittedConfig:
    """Size the KV pool from its memory budget and fit ``max_model_len`` to it.

    Raises ``ConfigError`` when the budget cannot hold even one sequence of the
    requested ``max_model_len``, and the model-loading errors for a bad directory.
    """
    model_dir = Path(config.model.model)
    if not model_dir.is_dir():
        from aserve.errors import ModelFileNotFoundError

        raise ModelFileNotFoundError(f"model directory {model_dir} does not exist")
    arch = load_arch_config(model_dir)
    check_architecture(arch.architecture)  # fail early, naming the supported ones
    # Resolved once, here, and passed on in the fitted config: the workers (and, with
    # --headless nodes, every node) then compute on the device, and in the dtype, the KV
    # cache was sized for.
    gpus = cuda_device_count() if config.model.device != "cpu" else 0
    device = resolve_device(config.model.device, gpus)
    tp_comm = resolve_tp_comm(config.parallel.tp_comm, device)
    tp_size = config.parallel.tensor_parallel_size
    if tp_comm == "nccl" and tp_size > gpus:
        raise ConfigError(f"tensor_parallel_size={tp_size} over NCCL needs a GPU per rank, and {gpus} are visible "
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
    per_block = bytes_per_block(arch, tp_size=config.parallel.tensor_parallel_size, dtype=kv_dtype, block_size=block_size)
    num_blocks = config.cache.kv_cache_memory // per_block
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_memory={config.cache.kv_cache_memory} bytes is too small: one block of {block_size} tokens "
            f"takes {per_block} bytes and at least 2 are needed",
            param="kv_cache_memory",
        )
    capacity = (num_blocks - 1) * block_size
    limit = arch.max_position_embeddings
    window = arch.raw.get("sliding_window")
    if isinstance(window, int) and window > 0 and arch.raw.get("use_sliding_window", True):
        limit = min(limit, window)  # aserve attends to the whole sequence: stay inside the window
    requested = config.model.max_model_len
    if requested is None:
        max_model_len = min(limit, capacity)
    else:
        if requested > limit:
            raise ConfigError(
                f"max_model_len={requested} exceeds the model's limit of {limit} positions", param="max_model_len"
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


class EngineCore:
    def __init__(self, fitted: FittedConfig, executor_factory: Callable[[EngineConfig], object]) -> None:
        config = fitted.config
        self.config = config
        self.arch = fitted.arch
        self.kv_capacity_tokens = fitted.kv_capacity_tokens
        self.executor = executor_factory(config)
        assert config.cache.num_blocks is not None
        self.kv = KVCacheManager(
            config.cache.num_blocks, config.cache.block_size, enable_prefix_caching=config.cache.enable_prefix_caching,
            prefix_cache_reserve=config.cache.prefix_cache_reserve,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len=config.max_model_len)
        # Steps handed to the executor whose output has not been read, oldest first. An
        # executor whose model runs elsewhere (worker processes) takes a second step while
        # the first runs: the engine schedules and processes outputs during the model step
        # instead of leaving the worker idle (asynchronous scheduling).
        self.max_inflight = getattr(self.executor, "max_inflight", 1)
        self._inflight: deque = deque()
        # Totals since start, for metrics: the engine's own count of what it served, the
        # same whichever API server asks.
        self.num_requests_received = 0
        self.num_requests_finished = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def prepare_request(self, request: EngineCoreRequest) -> Request:
        """Validate and build the scheduler's request (its prompt block hashes too).

        Separate from :meth:`add_prepared` so the engine-core process can do this work in
        its input task, overlapped with the model step in progress.
        """
        if len(request.prompt_token_ids) >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(request.prompt_token_ids)} tokens; max_model_len is {self.config.max_model_len}",
                param="prompt",
            )
        prepared = Request(request, max_model_len=self.config.max_model_len)
        prepared.update_block_hashes(self.config.cache.block_size)
        return prepared

    def add_prepared(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.num_requests_received += 1
        self.num_prompt_tokens += request.num_prompt_tokens

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_prepared(self.prepare_request(request))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self._count(self.scheduler.abort_requests(request_ids))

    def _count(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for out in outputs:
            self.num_generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.num_requests_finished += 1
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule a step, and return the progress of the oldest step in flight once
        ``max_inflight`` are (or nothing more can be scheduled).

        With ``max_inflight`` 1 this is: schedule, run the model, update. With 2, a call
        that leaves only one step in flight returns nothing at once, so the caller can
        take new input before the next call schedules the second step.
        """
        executor = self.executor
        if len(self._inflight) < self.max_inflight:
            sched = self.scheduler.schedule()
            if not sched.is_empty or sched.freed_req_ids:
                executor.submit_model(sched)  # type: ignore[attr-defined]
                self._inflight.append(sched)
                if len(self._inflight) < self.max_inflight:
                    return []
        if not self._inflight:
            return []
        sched = self._inflight.popleft()
        runner_output = executor.wait_model()  # type: ignore[attr-defined]
        return self._count(self.scheduler.update_from_output(sched, runner_output))

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def ping(self) -> str:
        return "pong"

    def get_stats(self) -> dict[str, float]:
        """Counts for tests, health and metrics (a UTILITY call)."""
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage,
            "num_free_blocks": self.kv.pool.num_free_blocks,
            "num_usable_blocks": self.kv.pool.num_usable_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_received": self.num_requests_received,
            "num_requests_finished": self.num_requests_finished,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()  # type: ignore[attr-defined]
