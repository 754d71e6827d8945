"""Decode steps replayed from captured CUDA graphs (the GPU path with the Triton kernels).

A decode step of a small model on a GPU is bound by launches: every layer is a dozen
kernels launched from Python. A CUDA graph records the launches of one whole forward pass
once and replays them in one call. A graph replays fixed shapes over fixed memory, so:

- one graph is captured per bucket of batch sizes (:func:`capture_sizes`: 1, 2, 4, then
  every multiple of 8 up to ``max_size``), largest first, all in one memory pool;
- the step's inputs live in persistent buffers sized for the largest bucket: token ids,
  positions, slots, sequence lengths, and a block table of a fixed width (the blocks of
  the longest sequence the engine serves, ``max_model_len / block_size``), all views of
  one int64 device tensor;
- a step of ``n`` decode rows is written into the first ``n`` rows of a host mirror of
  those buffers (pinned memory on a GPU), padded there to the smallest bucket
  ``b >= n``, its block table packed at its own width, and sent in one non-blocking
  copy; one device copy puts the table's rows in place, then the bucket's graph is
  replayed. Rows ``n .. b`` are padding: slot -1 (the Triton store skips it), length 1,
  token 0, and their outputs are dropped. One copy and no padding kernels, because on a
  GPU each small copy from pageable memory waits for the stream, and those waits were
  most of a small model's step (docs/cuda.md);
- a step with a prefill chunk, more rows than the largest bucket, or that asks for
  something the graph does not compute runs eagerly, as without graphs.

The Triton decode kernel reads only the blocks of each row's own length, so the fixed
table width costs launches of empty programs, not reads. Only the model's forward pass is
captured; the logits and the sampler run eagerly on the rows that are real.

Capture needs a forward pass without host synchronisation: the attention and ops of the
Triton path, collectives over NCCL. Layers that route on the host (mixture-of-experts
routing reads its token counts back) set ``graph_unsafe`` and keep the model eager.

:class:`EagerReplay` runs the same buffers and padding with no graph at all: the same
code path on CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable, Protocol

import torch

from aserve.kernels.attention import AttentionMetadata, LayerKV

logger = logging.getLogger("aserve.worker")

Replay = Callable[[], torch.Tensor]


def capture_sizes(max_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8 (vLLM's buckets), up to the
    first that holds ``max_size`` rows."""
    if max_size < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_size}")
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= max_size:
            return sizes
    raise AssertionError("unreachable")


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        """Record ``fn`` (a forward pass over the persistent buffers); return what replays it."""
        ...


class CudaGraphBackend:
    """Real CUDA graphs: every graph in one memory pool (captured largest first, so the
    smaller ones reuse the largest's activations' memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        # Warm up on a side stream first (Triton compiles its kernels, cuBLAS picks its
        # algorithms): neither may happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out  # the graph's own memory, rewritten by each replay

        return replay


class EagerReplay:
    """No graph: each "replay" runs the forward pass again over the persistent buffers.
    The padding, buckets and buffer handling are the same as with CUDA graphs."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        fn()
        return fn


class DecodeGraphs:
    """The captured decode steps of one model runner, and their persistent inputs."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[LayerKV], *, sizes: list[int], max_blocks: int,
                 device: torch.device, backend: GraphBackend, mirror: bool | None = None) -> None:
        """``mirror``: write each step into a host mirror and send it in one copy (the
        default on a CUDA device, where the mirror is pinned); without it the step is
        written into the buffers themselves (on the CPU). The tests take the mirrored
        path on the CPU too."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks
        self.backend = backend
        rows = self.sizes[-1]
        on_gpu = device.type == "cuda"
        mirrored = on_gpu if mirror is None else mirror
        # One tensor: [ids | positions | slots | lengths] (``rows`` each), then, when
        # mirrored, a staging area, then the table [rows, max_blocks]. The host mirror is
        # the first two parts: a step's header and its own table, packed ([n, width], its
        # widest row's blocks), cross in one copy, and one device copy puts the table's
        # rows in place. Sending the table at its captured width instead would cost
        # max_model_len / block_size entries a row (16 MB a step at 256 rows of a 128k
        # context).
        staging = rows * max_blocks if mirrored else 0
        self._inputs = torch.zeros(4 * rows + staging + rows * max_blocks, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self._inputs[: 4 * rows].view(4, rows).unbind(0)
        self.block_table = self._inputs[4 * rows + staging :].view(rows, max_blocks)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self._host = None
        if mirrored:
            self._host = torch.zeros(4 * rows + staging, dtype=torch.long, pin_memory=on_gpu)
            self._host[: 4 * rows].copy_(self._inputs[: 4 * rows])
        # Where a step's header is written: the mirror, or the buffers themselves.
        self._head = (self._inputs if self._host is None else self._host)[: 4 * rows].view(4, rows).unbind(0)
        # Recorded after each copy: the host mirror is not rewritten before the copy read it.
        self._copied = torch.cuda.Event() if mirrored and on_gpu else None
        self.sent_elements = 0  # int64s the last step sent to the device (the tests read it)
        self.replays: dict[int, Replay] = {}
        self.replayed = 0  # steps served by a graph (the tests and the start-up log read it)
        self.capture_seconds = 0.0

    def capture(self) -> None:
        started = time.perf_counter()
        for size in reversed(self.sizes):
            self.replays[size] = self.backend.capture(self._forward_fn(size))
        self.capture_seconds = time.perf_counter() - started

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(self.slot_mapping[:size], size, self.block_table[:size], None, (), None,
                                 decode_seq_lens=self.seq_lens[:size], triton=True)
        ids, positions, kv = self.input_ids[:size], self.positions[:size], self.kv_caches

        def forward() -> torch.Tensor:
            return self.model(ids, positions, kv, meta)

        return forward

    def bucket(self, rows: int) -> int | None:
        """The smallest captured size holding ``rows`` rows, or None."""
        return next((s for s in self.sizes if s >= rows), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """The hidden states ([n, hidden]) of a decode-only step of ``n`` rows, one token
        each, replayed from the bucket's graph; None where no graph fits (the caller
        runs the step eagerly). Inputs are host (CPU) tensors; they go to the device in
        one copy, padded to the bucket here."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = block_table.shape[1]
        if size is None or width > self.max_blocks:
            return None
        rows = self.sizes[-1]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy is done with the mirror
        ids, pos, slots, lens = self._head
        ids[:n], pos[:n], slots[:n], lens[:n] = input_ids, positions, slot_mapping, seq_lens
        if size > n:  # padding rows: stored nowhere, one key each (a stale table row is a valid block)
            ids[n:size] = 0
            pos[n:size] = 0
            slots[n:size] = -1
            lens[n:size] = 1
        if self._host is None:
            self.block_table[:n, :width] = block_table
        else:
            end = 4 * rows + n * width
            self._host[4 * rows : end].view(n, width).copy_(block_table)
            self._inputs[:end].copy_(self._host[:end], non_blocking=self._copied is not None)
            if self._copied is not None:
                self._copied.record()
            self.block_table[:n, :width].copy_(self._inputs[4 * rows : end].view(n, width))
            self.sent_elements = end
        hidden = self.replays[size]()
        self.replayed += 1
        return hidden[:n]


def graph_blockers(model: torch.nn.Module) -> list[str]:
    """Names of the model's modules that cannot be captured (``graph_unsafe``)."""
    return [name for name, module in model.named_modules() if getattr(module, "graph_unsafe", False)]
