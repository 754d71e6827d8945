"""``EngineArgs``: every engine option, once, with its type, default, help and checks.

The one way in. ``LLM(model, **kwargs)`` and ``AsyncLLM(model, **kwargs)`` take exactly
these fields as keyword arguments (an unknown keyword is a ``TypeError`` that names the
closest field), and ``aserve run | generate | bench`` generate their engine flags from
them (:func:`add_cli_arguments`): ``tensor_parallel_size`` is ``--tensor-parallel-size``
(alias ``--tp``), a boolean ``enable_prefix_caching`` is ``--enable-prefix-caching`` /
``--no-enable-prefix-caching``. Names and meanings follow vLLM's ``EngineArgs`` where
they are the same.

One default differs by who runs the engine, as in vLLM: ``max_num_batched_tokens``
(None) is, per TP rank, 1024 tokens for a server on a CPU and 2048 on CUDA, 4096 for
the library (:meth:`EngineArgs.create_engine_config`'s ``usage``;
:func:`default_step_budget`).

``EngineArgs`` -> ``EngineConfig`` (:meth:`create_engine_config`) -> fitted to the model
(``aserve.engine.fit.fit_config``), once, by whoever starts the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from aserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_PREFIX_CACHE_RESERVE,
    DEFAULT_STARTUP_TIMEOUT,
    DTYPES,
    LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    SERVER_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    TP_COMMS,
    CacheConfig,
    EngineConfig,
    HealthConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from aserve.devices import DEVICES, cuda_device_count, resolve_device
from aserve.model.pipeline import parse_partition
from aserve.errors import ConfigError

Usage = Literal["library", "server"]


def default_step_budget(usage: Usage, device: str, tensor_parallel_size: int) -> int:
    """The token budget of one step when ``max_num_batched_tokens`` is not given: the
    per-rank default for ``usage`` (and, for a server, the resolved ``device``: ``cpu``
    or ``cuda``) times the TP size (aserve/config.py says why each)."""
    per_rank = (SERVER_MAX_NUM_BATCHED_TOKENS_PER_RANK[device] if usage == "server"
                else LIBRARY_MAX_NUM_BATCHED_TOKENS_PER_RANK)
    return per_rank * tensor_parallel_size


def _option(default: Any, help: str, *, aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None,
            minimum: float | None = None, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices,
                                            "minimum": minimum, "metavar": metavar})


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options. Raises ``ConfigError`` (naming the field as ``param``) for
    a value of the wrong type or out of range; checks that need the model happen when
    the config is fitted to it."""

    model: str | None = _option(None, "Hugging Face-format model directory (default: the embedded model)")
    # -- the model ---------------------------------------------------------------------
    dtype: str = _option("auto", "weight and activation dtype (default auto: the checkpoint's; float32 on a CPU "
                         "without native products of the checkpoint's half dtype)", choices=DTYPES)
    max_model_len: int | None = _option(None, "longest sequence (prompt + output) to serve (default: the model's "
                                        "limit, fitted to the KV cache)", minimum=1)
    seed: int = _option(0, "seed of the engine's random generator")
    device: str = _option("auto", "where the model runs (auto: CUDA when a GPU is visible, else the CPU)",
                          choices=DEVICES)
    enforce_eager: bool = _option(False, "on a GPU, run every step eagerly: no CUDA graphs for decode steps")
    max_cudagraph_capture_size: int | None = _option(None, "on a GPU, the largest decode batch captured as a CUDA "
                                                     "graph (buckets 1, 2, 4, 8, 16, ...; default: max-num-seqs, "
                                                     "at most 256)", minimum=1)
    # -- the KV cache ------------------------------------------------------------------
    kv_cache_memory: int = _option(DEFAULT_CPU_KV_CACHE_MEMORY, "bytes for the KV cache over all layers and "
                                   "ranks (also 4GiB, 512MiB, ...; default 4 GiB)", minimum=1, metavar="BYTES")
    kv_cache_dtype: str = _option("auto", "dtype the KV cache stores keys and values in (default: the model's). "
                                  "bfloat16 under a float32 model halves the cache's memory and the bytes a decode "
                                  "step reads", choices=DTYPES)
    block_size: int = _option(16, "tokens per KV cache block (a power of two)", minimum=1)
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompt prefixes seen before")
    prefix_cache_reserve: float = _option(DEFAULT_PREFIX_CACHE_RESERVE, "share of the KV pool that freed, cached "
                                          "prefixes may fill before blocks never used yet are touched (1.0: all)")
    # -- the scheduler -----------------------------------------------------------------
    max_num_seqs: int = _option(256, "requests in one step", minimum=1)
    max_num_batched_tokens: int | None = _option(None, "token budget of one step (default, x the TP size: "
                                                 "a server 1024 on CPU, 2048 on CUDA; the library 4096)",
                                                 minimum=1)
    enable_chunked_prefill: bool = _option(True, "prefill prompts longer than the step's budget in chunks")
    long_prefill_token_threshold: int | None = _option(None, "prefill a prompt longer than this in chunks of at "
                                                       "most this many tokens, so running requests keep "
                                                       "streaming", minimum=1)
    # -- parallelism and processes ---------------------------------------------------------
    tensor_parallel_size: int = _option(1, "tensor-parallel ranks of each engine", aliases=("--tp",), minimum=1)
    pipeline_parallel_size: int = _option(1, "pipeline stages of each engine, each with its own layers and "
                                          "tensor-parallel ranks", aliases=("--pp",), minimum=1)
    pp_layer_partition: str | None = _option(None, "layers of each pipeline stage, comma-separated (e.g. 5,7; "
                                             "default: even, extra layers before the last stage)", metavar="N,N,...")
    data_parallel_size: int = _option(1, "data-parallel engines, each with its own TP group", aliases=("--dp",),
                                      minimum=1)
    tp_comm: str = _option("auto", "how the workers of one engine exchange activations: shm (CPU shared memory), "
                           "nccl (CUDA), gloo (gloo's TCP for every collective, either device); auto: shm on CPU, "
                           "nccl on CUDA", choices=TP_COMMS)
    nnodes: int = _option(1, "machines one engine spans (its workers split evenly over them; the first runs the "
                          "engine core and the API servers)", minimum=1)
    node_rank: int = _option(0, "this machine's place among --nnodes (0: the head; the others run with "
                             "--headless)")
    master_addr: str = _option("127.0.0.1", "the head's address, where every node's workers meet "
                               "(torch.distributed's rendezvous)")
    master_port: int = _option(29501, "the head's rendezvous port; the two after it carry the engine core's "
                               "calls to remote workers and their replies", minimum=1)
    worker_threads: int | None = _option(None, "torch threads per worker (default: this node's cores / its "
                                         "workers). On a small machine a tiny model serves faster with fewer, "
                                         "leaving cores to the API server", minimum=1)
    cpu_affinity: bool = _option(True, "pin workers to cores of their own when their threads leave cores free "
                                 "(docs/configuration.md)")
    heartbeat_timeout: float = _option(DEFAULT_HEARTBEAT_TIMEOUT, "seconds without a heartbeat after which an "
                                       "engine process counts as dead", minimum=0)
    startup_timeout: float = _option(DEFAULT_STARTUP_TIMEOUT, "seconds to wait for every engine to load and "
                                     "report ready", minimum=0)
    execute_model_timeout: float | None = _option(None, "seconds a model step may go without progress (a "
                                                  "layer done in a worker) before the engine counts as hung "
                                                  "(default: 10x the longest step measured, at least 60)",
                                                  minimum=0)

    def __post_init__(self) -> None:
        for f in fields(self):  # in order, so --tp 0 is reported as --tp, not as what it implies
            _check_field(f, getattr(self, f.name))

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, owner: str, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
        """``EngineArgs(model, **kwargs)`` for ``owner`` (``"LLM"``, ``"AsyncLLM"``); an
        unknown keyword is a ``TypeError`` naming the closest field."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else "; the engine options are aserve.EngineArgs' fields"
                raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}{hint}")
        return cls(model=model, **kwargs)

    def create_engine_config(self, usage: Usage = "library", *, data_parallel_size_local: int | None = None,
                             model: str | None = None) -> EngineConfig:
        """The validated config (``ConfigError`` names the field). ``model``: the resolved
        model directory (default: :func:`resolve_model_path` of ``self.model``, which
        builds the embedded model on first use)."""
        budget = self.max_num_batched_tokens
        if not budget:
            # A server's default depends on the device (resolved again, the same way, by
            # fit_config); the library's does not, so it asks no driver.
            device = "cpu"
            if usage == "server":
                device = resolve_device(self.device, cuda_device_count() if self.device != "cpu" else 0)
            budget = default_step_budget(usage, device, self.tensor_parallel_size)
        return EngineConfig(
            model=ModelConfig(model or resolve_model_path(self.model), dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed, device=self.device,
                              enforce_eager=self.enforce_eager,
                              max_cudagraph_capture_size=self.max_cudagraph_capture_size),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              enable_prefix_caching=self.enable_prefix_caching,
                              prefix_cache_reserve=self.prefix_cache_reserve, kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=self.max_num_seqs,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    pp_layer_partition=parse_partition(self.pp_layer_partition),
                                    data_parallel_size=self.data_parallel_size,
                                    data_parallel_size_local=data_parallel_size_local,
                                    worker_threads=self.worker_threads, node_cpus=node_cpus(),
                                    cpu_affinity=self.cpu_affinity, tp_comm=self.tp_comm, nnodes=self.nnodes,
                                    node_rank=self.node_rank, master_addr=self.master_addr,
                                    master_port=self.master_port),
            health=HealthConfig(heartbeat_timeout=self.heartbeat_timeout, startup_timeout=self.startup_timeout,
                                execute_model_timeout=self.execute_model_timeout),
        )


def _check_field(f: dataclasses.Field, value: Any) -> None:
    name, meta = f.name, f.metadata
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
    base, _, optional = str(f.type).partition(" | ")
    if value is None:
        if optional != "None":
            raise ConfigError(f"{name} must not be None", param=name)
        return
    expected = kinds[base]
    if isinstance(value, bool) and base != "bool" or not isinstance(value, expected):
        raise ConfigError(f"{name} must be {'a number' if base == 'float' else f'of type {base}'}, got "
                          f"{value!r}", param=name)
    if meta.get("choices") and value not in meta["choices"]:
        hint = " (no fp8 KV cache on CPU)" if name == "kv_cache_dtype" and str(value).startswith("fp8") else ""
        raise ConfigError(f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}{hint}", param=name)
    minimum = meta.get("minimum")
    if minimum is not None:
        if minimum == 0 and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}", param=name)
        if minimum != 0 and value < minimum:
            raise ConfigError(f"{name} must be >= {minimum}, got {value}", param=name)


def resolve_model_path(model: str | None) -> str:
    """The model directory; the default model in the package (``aserve.default_model``)
    when None."""
    if model is None:
        from aserve.default_model import default_model_dir

        return str(default_model_dir())
    return model


def node_cpus() -> tuple[int, ...] | None:
    """The cores this process may run on (the node's share for aserve's processes)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return None


# -- the command line ------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``4294967296``, ``4GiB``, ``4G`` (powers of 1024) or ``4GB`` (powers of 1000)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (say 4294967296 or 4GiB)")
    number, unit, binary = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1024 if binary or (unit and not text.strip().lower().endswith("b")) else 1000
    return int(float(number) * base**power)


def flag(name: str) -> str:
    """The command-line flag of field ``name``."""
    return "--" + name.replace("_", "-")


def add_cli_arguments(parser: argparse.ArgumentParser, *, model_positional: bool) -> None:
    """One flag per ``EngineArgs`` field (the model as a positional argument for ``run``)."""
    group = parser.add_argument_group("engine options (aserve.EngineArgs)")
    for f in fields(EngineArgs):
        meta = f.metadata
        default_text = "" if f.default is None or isinstance(f.default, bool) else f" (default {f.default})"
        if f.name == "kv_cache_memory":
            default_text = ""
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"] + default_text}
        if f.name == "model" and model_positional:
            group.add_argument("model", nargs="?", default=None, help=meta["help"])
            continue
        base = str(f.type).partition(" | ")[0]
        if base == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = parse_bytes if f.name == "kv_cache_memory" else {"int": int, "float": float, "str": str}[base]
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        group.add_argument(flag(f.name), *meta["aliases"], **kwargs)


def from_cli(namespace: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` that :func:`add_cli_arguments`' flags parsed into."""
    return EngineArgs(**{f.name: getattr(namespace, f.name) for f in fields(EngineArgs)})
