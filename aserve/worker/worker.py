"""One rank's share of the model: loads its shard, owns its KV cache, runs steps.

Executors call these methods (in-process for TP = 1, over the shared-memory ring for
worker processes). The set is fixed and explicit; nothing is looked up by name from
a message.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from aserve.config import EngineConfig
from aserve.envs import read_env
from aserve.errors import ConfigError
from aserve.distributed.pp_group import PPGroup
from aserve.distributed.tp_group import TPGroup
from aserve.model.hf_config import load_arch_config
from aserve.kernels.bf16_linear import load_best as load_bf16_linear
from aserve.kernels.cpu_fused_ops import attach as attach_fused_ops
from aserve.kernels.cpu_decode_attention import build as build_decode_attention
from aserve.kernels.cpu_fused_ops import load as load_fused_ops
from aserve.kernels.f32_linear import load as load_f32_linear
from aserve.kernels.llama_decode import build_float32 as build_float32_decode_stack
from aserve.kernels.llama_decode import load as load_decode_stack
from aserve.kernels.llama_decode import load_float32 as load_float32_decode_stack
from aserve.kernels.token_mask import load as load_token_mask
from aserve.progress import ProgressBar
from aserve.model.layers.linear import prepack_linears
from aserve.model.loader import load_model, resolve_dtype
from aserve.wire.worker_messages import RunnerOutput, SchedulerOutput
from aserve.worker.cpu_memory import keep_freed_memory, release_free_memory
from aserve.model.kv_spec import local_kv_heads
from aserve.model.pipeline import Stage, stage_layers
from aserve.worker.cuda_graphs import graph_blockers
from aserve.worker.model_runner import ModelRunner

logger = logging.getLogger("aserve.worker")


def triton_chosen(device: torch.device) -> bool:
    """Whether the Triton kernels serve (``ASERVE_TRITON``): by default on a GPU, when
    triton is installed; ``1`` also on CPU tensors, through Triton's interpreter (tests:
    it must be ``TRITON_INTERPRET=1`` before triton is imported); ``0`` never. Raises
    ConfigError where ``1`` cannot be honoured."""
    choice = read_env().triton
    if choice == "off" or (device.type == "cpu" and choice != "on"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if choice == "on":
            raise ConfigError("ASERVE_TRITON=1, but triton is not installed", param="ASERVE_TRITON") from None
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("ASERVE_TRITON=1 on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 too",
                          param="ASERVE_TRITON")
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        # Served, but from the interpreter, one program at a time on the host: a test
        # setting that leaked into this environment (how the first GPU run found it).
        logger.warning("TRITON_INTERPRET=1: the Triton kernels run in Triton's interpreter on the host, not compiled "
                       "for the GPU (orders of magnitude slower); unset it to serve at the GPU's speed")
    return True


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup, *, show_progress: bool = False, dp_rank: int = 0,
                 pp: PPGroup | None = None) -> None:
        """``config`` must be fitted (``max_model_len``, ``num_blocks`` and the device
        known). On CUDA the model goes to the current device (a worker process sets it
        before it joins its TP group; in process it is GPU 0 unless the caller set one).
        ``pp``: this worker's pipeline stage (None: the whole model)."""
        self.config = config
        self.tp = tp
        self.pp = pp
        on_cpu = config.model.device != "cuda"
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        model_dir = Path(config.model.model)
        arch = load_arch_config(model_dir)
        self.dtype = resolve_dtype(config.model.dtype, arch)
        kv_name = config.cache.kv_cache_dtype
        self.kv_dtype = self.dtype if kv_name == "auto" else resolve_dtype(kv_name, arch)
        keep_freed_memory()
        self.model_dir, self.arch = model_dir, arch
        self.dp_rank = dp_rank
        self._profiler: Any = None
        self._profile_dir = Path(".")
        self._asleep_without_weights = False
        self.use_triton = triton_chosen(self.device)
        stages = stage_layers(arch.num_hidden_layers, config.parallel.pipeline_parallel_size,
                              config.parallel.pp_layer_partition)
        rank = 0 if pp is None else pp.stage
        self.stage = Stage(rank, len(stages), *stages[rank])
        model = self._build_model(show_progress)
        if on_cpu:
            release_free_memory()
        self.runner = ModelRunner(model, block_size=config.cache.block_size, seed=config.model.seed,
                                  device=self.device,
                                  token_mask=load_token_mask(), triton_attention=self.use_triton, pp=pp)
        assert config.cache.num_blocks is not None
        self.runner.init_kv_cache(
            config.cache.num_blocks,
            num_layers=self.stage.num_layers,
            num_kv_heads=local_kv_heads(arch, tp.size),
            head_dim=arch.head_dim,
            dtype=self.kv_dtype,
            model_dtype=self.dtype,
        )
        self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> None:
        """On a GPU with the Triton kernels, capture the decode steps as CUDA graphs (unless
        ``enforce_eager``, or a layer cannot be captured); logs what it did and how long
        it took (counted in start-to-ready)."""
        config, say = self.config, self.tp.rank == 0
        if self.device.type != "cuda" or config.model.enforce_eager:
            return
        if self.stage.size > 1:
            if say:
                logger.info("decode steps run eagerly: no CUDA graphs with pipeline stages")
            return
        if not self.use_triton:
            if say:
                logger.info("decode steps run eagerly: CUDA graphs need the Triton kernels (triton is not installed "
                            "or ASERVE_TRITON=0)")
            return
        blockers = graph_blockers(self.runner.model)
        if self.tp.size > 1 and config.parallel.tp_comm != "nccl":
            blockers.append(f"tp_comm {config.parallel.tp_comm} (only NCCL's collectives can be captured)")
        if blockers:
            if say:
                logger.info("decode steps run eagerly, no CUDA graphs: %s", ", ".join(blockers[:3]))
            return
        max_size = config.model.max_cudagraph_capture_size or min(config.scheduler.max_num_seqs, 256)
        max_blocks = -(-config.max_model_len // config.cache.block_size)
        graphs = self.runner.capture_decode_graphs(max_size=max_size, max_blocks=max_blocks)
        if say:
            logger.info("CUDA graphs: decode batches of %s rows captured in %.1f s",
                        ", ".join(map(str, graphs.sizes)), graphs.capture_seconds)

    def _build_model(self, show_progress: bool = False, *, at_start: bool = True) -> torch.nn.Module:
        """The model, loaded, on its device, in its kernels' forms (packed linears, the
        fused ops, the one-call decode step where the layers allow it): at start-up, and
        again on waking from a level-2 sleep (``at_start`` False: no log lines again)."""
        config, tp, arch, on_cpu = self.config, self.tp, self.arch, self.device.type == "cpu"
        say = tp.rank == 0 and at_start  # each choice said once, at start-up
        progress = ProgressBar("aserve: loading weights") if show_progress else None
        model = load_model(self.model_dir, arch, dtype=self.dtype, max_positions=config.max_model_len, tp=tp,
                           progress=progress, stage=self.stage)
        if not on_cpu:
            # Loaded into host memory, shard by shard; one copy to the GPU. Tied weights
            # stay tied (Module.to replaces each parameter's data in place).
            model.to(self.device)
        blockers = model.fast_path_blockers() if hasattr(model, "fast_path_blockers") else []
        ahead = self._build_kernels_ahead(model, blockers) if on_cpu and not self.use_triton else []
        f32 = load_f32_linear() if self.dtype == torch.float32 and on_cpu else None
        # bf16: AMX tiles, else the AVX512-BF16 kernel, else oneDNN (bf16_linear.load_best).
        bf16 = load_bf16_linear() if self.dtype == torch.bfloat16 and on_cpu else None
        prepack_linears(model, bf16, f32)
        if on_cpu and say:  # ASERVE_CPU_F32_LINEAR, ASERVE_CPU_AMX, ASERVE_CPU_BF16_LINEAR = 0 turn kernels off
            if self.dtype == torch.float32:
                logger.info("float32 linear layers: %s", "oneDNN and MKL (the kernel is off or cannot run here)"
                            if f32 is None else f"aserve's kernel, {'AVX-512' if f32.form == 512 else 'AVX2'} form")
            elif self.dtype == torch.bfloat16:
                logger.info("bf16 linear layers: %s", {None: "oneDNN (no AMX or AVX512-BF16, or off)",
                                                       "amx": "AMX tiles",
                                                       "avx512_bf16": "aserve's AVX512-BF16 kernel"}[
                    None if bf16 is None else bf16.kind])
        if self.use_triton:
            from aserve.kernels.triton_ops import TritonOps

            attach_fused_ops(model, TritonOps(interpret=on_cpu))
            if say:
                logger.info("attention, the KV store, norms, rotary and activations: Triton kernels%s",
                            " (its interpreter, on CPU tensors)" if on_cpu else "")
        elif self.dtype in (torch.float32, torch.bfloat16) and on_cpu:
            fused = load_fused_ops()
            if fused is not None:
                attach_fused_ops(model, fused)
                # Decode steps through every layer from C, where the model's layers
                # allow it (bf16 on AMX or AVX512-BF16, float32 on AVX2 or AVX-512;
                # aserve/kernels/llama_decode.py).
                kernel = None
                if blockers and say:
                    # These layers run the layer-by-layer path (and, where the reason is
                    # attention's, the masked torch attention).
                    logger.info("decode steps run layer by layer, not in one C call: %s (%s)",
                                ", ".join(blockers), arch.architecture)
                if hasattr(model, "attach_decode_stack") and not blockers:
                    if self.dtype == self.kv_dtype == torch.bfloat16 and bf16 is not None:
                        kernel = load_decode_stack(bf16.kind)  # over the kernel the layers were packed for
                    elif self.dtype == torch.float32:
                        kernel = load_float32_decode_stack()  # waits on the build's lock if a thread still builds it
                if kernel is not None and model.attach_decode_stack(kernel) and at_start:
                    logger.info("rank %d: decode steps run the decoder layers from C (%s)", tp.rank,
                                "one call" if tp.size == 1 else "two calls a layer, all-reduced between")
        for thread in ahead:  # none outlives the model's building
            thread.join()
        return model

    def _build_kernels_ahead(self, model: torch.nn.Module, blockers: list[str]) -> list[threading.Thread]:
        """Start compiling, each on a thread, the two C kernels slowest to build that this
        worker will load: the decode attention (the KV pool's, ModelRunner.init_kv_cache)
        and the float32 one-call decode step (7.8 and 9.3 s on a Zen 1 core). Their
        compilers then run beside the weights' packing and the other kernels' builds, and
        a first start on two cores waits about half as long for its kernels
        (docs/engine.md). Once built, a library is found in the cache: the threads return
        at once. A load of a library a thread is still building waits on the build's lock
        (``cbuild.build``) instead of compiling it again."""
        kernel_dtypes = (torch.float32, torch.bfloat16)
        jobs = []
        if self.dtype in kernel_dtypes and self.kv_dtype in kernel_dtypes:
            jobs.append(build_decode_attention)
        if self.dtype == torch.float32 and hasattr(model, "attach_decode_stack") and not blockers:
            jobs.append(build_float32_decode_stack)
        threads = [threading.Thread(target=job, name=f"aserve-build-{job.__name__}", daemon=True) for job in jobs]
        for thread in threads:
            thread.start()
        return threads

    # -- sleep and profile (the engine's utility calls; docs/engine.md, "Sleep") ----------

    def sleep(self, level: int) -> None:
        """Level 1: drop the KV pool's contents and give its memory back (on CPU the
        mapping stays and its pages go to the kernel; on a GPU the tensor is freed).
        Level 2: the weights too (reloaded from the checkpoint on waking). Idempotent
        for the same level; the engine core sleeps only without requests in flight."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.runner.release_kv_cache()
        if level == 2 and self.runner.model is not None:
            self.runner.model = None
            self._asleep_without_weights = True
        gc.collect()
        if self.device.type == "cpu":
            release_free_memory()
        else:
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: the weights reloaded if they were released, the KV pool
        usable again (empty: the engine core reset its prefix cache)."""
        if getattr(self, "_asleep_without_weights", False):
            self.runner.model = self._build_model(at_start=False)
            self._asleep_without_weights = False
            if self.device.type == "cpu":
                release_free_memory()
        self.runner.restore_kv_cache()
        self.runner.recapture_decode_graphs()  # the old graphs pointed at the freed pool

    def start_profile(self, directory: str) -> None:
        """Record a ``torch.profiler`` trace of this worker's steps until :meth:`stop_profile`."""
        if self._profiler is not None:
            raise RuntimeError("a profile is already being recorded")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._profile_dir = Path(directory)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop recording and write the trace (Chrome's JSON format, one file per worker);
        returns its path."""
        if self._profiler is None:
            raise RuntimeError("no profile is being recorded (start_profile first)")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        stage = f"pp{self.stage.rank}_" if self.stage.size > 1 else ""
        path = self._profile_dir / f"worker_dp{self.dp_rank}_{stage}tp{self.tp.rank}_{os.getpid()}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_model(sched)
