"""Runs one step of the model on this rank: inputs from the scheduler's deltas,
attention metadata, the forward pass, logits, and sampling.

The runner keeps every scheduled request's tokens and block table between steps, so a
``SchedulerOutput`` carries only what changed. It appends the tokens it samples itself;
every tensor-parallel rank samples the same tokens, so the ranks stay in agreement
without being told the results. With pipeline stages only the last stage samples; the
stages before it take each request's tokens from the step that schedules it
(``CachedRequestData.new_token_ids``).

On CUDA the step's inputs are built on the host as on CPU and copied over once; the KV
pool is device memory, attention runs the Triton kernels (or, without triton, SDPA over
gathered blocks; the C kernels are CPU-only), and the sampler runs on the device too:
only the sampled token ids and requested logprobs come back to the host.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from aserve.kernels.attention import AttentionMetadata, LayerKV, PrefillChunk, gather_numel, head_major
from aserve.kernels.cpu_decode_attention import DecodeAttention
from aserve.kernels.cpu_decode_attention import load as load_decode_kernel
from aserve.kernels.cpu_decode_attention import PrefixLayouts, prefix_supported, shared_prefix_blocks
from aserve.kernels.cpu_fused_ops import load as load_fused_ops
from aserve.kernels.cpu_prefill_attention import PrefillAttention
from aserve.kernels.cpu_prefill_attention import load as load_prefill_kernel
from aserve.kernels.token_mask import TokenMaskKernel
from aserve.sampling_params import SamplingParams
from aserve.wire.worker_messages import GrammarMasks, RunnerOutput, SchedulerOutput
from aserve.distributed.pp_group import PPGroup
from aserve.worker.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend, capture_sizes
from aserve.worker.step_inputs import StepInputs
from aserve.worker.decode_staging import DecodeStaging
from aserve.worker.sampler import Sampler, SamplingRow, batched_logprobs
from aserve.wire.messages import TokenLogprobs


def _sampling_rows(scheduled: list[tuple[CachedRequestState, int]]) -> list[int]:
    """The rows whose scheduled tokens reach the end of their known tokens: they sample
    the next one (read by the last layer's row selection and by the sampler alike)."""
    return [r for r, (state, n) in enumerate(scheduled) if state.num_computed_tokens + n == len(state.token_ids)]


def _long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values)`` for a list of ints, through numpy: torch converts a list
    element by element (450 us for 4,096 ints on this machine, 6 us for 32), numpy in
    52 and 1.3 us. A step builds five such tensors and the block table."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))


def _allowed(masks: GrammarMasks, sample_ids: list[str]) -> tuple[list[int], np.ndarray] | None:
    """The sampler's view of ``masks``: (indices of the sampling rows they name, their
    int32 [k, words] rows in that order), or None when they name none of them."""
    index = {rid: k for k, rid in enumerate(masks.req_ids)}
    rows = [i for i, rid in enumerate(sample_ids) if rid in index]
    if not rows:
        return None
    bits = np.frombuffer(masks.bits, dtype="<i4").reshape(len(masks.req_ids), masks.words)
    order = [index[sample_ids[i]] for i in rows]
    # Usually the masks come in the rows' order, one for each: no copy.
    return rows, bits if order == list(range(len(bits))) else bits[order]


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: list[int]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, block_size: int, seed: int, use_decode_staging: bool = True,
                 device: torch.device | None = None, token_mask: TokenMaskKernel | None = None,
                 triton_attention: bool = False,
                 pp: PPGroup | None = None) -> None:
        """``device``: where ``model`` is (default: the CPU); ``token_mask``: the C
        kernel that applies structured outputs' masks (None: numpy);
        ``triton_attention``: attention and the KV store on the Triton kernels (the GPU
        path; on CPU tensors, Triton's interpreter), instead of the C kernels and torch;
        ``pp``: this rank's pipeline stage (None: the whole model). A stage before the
        last sends its hidden states on and gets the sampled tokens back; only the last
        stage samples.

        ``fetch_masks`` (set by whoever serves the engine's calls) returns the grammar
        masks of the step in progress when it asked for them (``masks_follow``); the
        engine core computes them (``aserve.engine.grammar``)."""
        self.fetch_masks: Callable[[], GrammarMasks] | None = None
        self.triton_attention = triton_attention
        self.pp = pp if pp is not None and pp.size > 1 else None
        self.model = model
        self.device = device or torch.device("cpu")
        self.on_cpu = self.device.type == "cpu"
        self.block_size = block_size
        self.sampler = Sampler(seed, token_mask)
        # Called after each layer a step runs layer by layer: the worker process sets its
        # progress counter here (aserve.process.heartbeat.Progress); None in process.
        self.layer_done: Callable[[], None] | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[LayerKV] = []
        self.model_dtype: torch.dtype | None = None  # set by init_kv_cache
        # Decode attention (chosen in init_kv_cache, once the dtype is known): the C kernel
        # over the paged cache where it builds (float32 and bfloat16), else SDPA over
        # dense staged copies (use_decode_staging) or over gathered blocks.
        self.decode_kernel: DecodeAttention | None = None
        # Whether that kernel attends over a prefix all decode rows share for all of them
        # at once (bf16 on AMX or AVX512-BF16): then each step finds that prefix's blocks.
        self.decode_prefix = False
        # The prefix phase's layouts kept between steps (set with decode_prefix).
        self.prefix_layouts: PrefixLayouts | None = None
        # Prefill chunks: the C kernel of the model's dtype (bf16: AMX or AVX512-BF16;
        # float32: AVX-512F or AVX2 + FMA) when the cache has that dtype too, else SDPA.
        self.prefill_kernel: PrefillAttention | None = None
        # The C write of a step's keys and values into the CPU pool (FusedOps.write_kv).
        self.kv_writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.use_decode_staging = use_decode_staging and self.on_cpu and not triton_attention
        self.staging: DecodeStaging | None = None
        self._kv_mapping: mmap.mmap | None = None  # the CPU pool's memory
        self._released_kv: tuple[tuple[int, ...], torch.dtype] | None = None  # a GPU pool freed by a sleep
        self.graphs: DecodeGraphs | None = None  # captured decode steps (capture_decode_graphs)
        self.step_inputs = None if self.on_cpu else StepInputs(self.device)  # the step's one copy to the device
        self._graph_args: dict | None = None

    def init_kv_cache(self, num_blocks: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      model_dtype: torch.dtype | None = None) -> None:
        """``dtype``: the cache's; ``model_dtype``: the queries', keys' and values' the
        model computes (default: the cache's)."""
        model_dtype = model_dtype or dtype
        self.model_dtype = model_dtype
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        shape = (num_layers, 2, num_blocks, self.block_size, num_kv_heads, head_dim)
        if not self.on_cpu:
            # Device memory, allocated (and zeroed: the masked-key rule below needs
            # finite values) up front; no kernel of this module runs there.
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches = [LayerKV(layer) for layer in cache.unbind(0)]
            return
        # One allocation for all layers, from an anonymous mapping: it reads as zeros,
        # and the kernel commits a page only when it is first written, so an idle pool
        # costs no resident memory.
        # Private, not Python's default shared mapping: nothing else maps the pool, and
        # a first write to a private page costs about a third less than to a shared
        # (shmem) one (256 MiB: 57 against 88 ms here), which every new block pays.
        # No huge pages: with MADV_HUGEPAGE the kernel compacts memory on those faults,
        # and the prefill's KV writes took 2.4x as long (docs/performance.md).
        self._kv_mapping = mmap.mmap(-1, math.prod(shape) * torch.empty((), dtype=dtype).element_size(),
                                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        cache = torch.frombuffer(self._kv_mapping, dtype=dtype)
        if self.triton_attention:  # the Triton kernels index the pool as one contiguous tensor
            cache = cache.view(shape)
        else:
            # Each block KV head by KV head (head_major), written by the C kernel where
            # it loads (``ASERVE_CPU_FUSED_OPS=0``: torch's index_put_).
            cache = head_major(cache, shape)
            fused = load_fused_ops()
            self.kv_writer = None if fused is None else fused.write_kv
        self.kv_caches = [LayerKV(layer) for layer in cache.unbind(0)]
        kernel_dtypes = (torch.float32, torch.bfloat16)
        if self.triton_attention:
            return  # the Triton kernels read the pool themselves
        if dtype in kernel_dtypes and model_dtype in kernel_dtypes:  # the pool is host memory: the CPU kernel applies
            self.decode_kernel = load_decode_kernel()
            self.decode_prefix = self.decode_kernel is not None and prefix_supported(dtype, model_dtype)
            self.prefix_layouts = PrefixLayouts(num_layers, num_kv_heads, head_dim) if self.decode_prefix else None
        if dtype == model_dtype and dtype in kernel_dtypes:  # each kernel reads a cache of its own dtype
            self.prefill_kernel = load_prefill_kernel(dtype)
        if self.use_decode_staging and self.decode_kernel is None:
            # Dense copies in the model's dtype, of the values the cache holds.
            self.staging = DecodeStaging(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                         dtype=model_dtype)

    def capture_decode_graphs(self, *, max_size: int, max_blocks: int, backend: GraphBackend | None = None) -> DecodeGraphs:
        """Capture decode steps of up to ``max_size`` rows whose block tables are at most
        ``max_blocks`` wide (:mod:`aserve.worker.cuda_graphs`); later decode-only steps
        that fit replay them. Needs the Triton attention path and a KV pool. ``backend``:
        CUDA graphs by default; :class:`EagerReplay` runs the same path without graphs."""
        if not self.triton_attention or not self.kv_caches:
            raise RuntimeError("decode graphs need the Triton attention path and an allocated KV pool")
        self._graph_args = dict(max_size=max_size, max_blocks=max_blocks, backend=backend)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, sizes=capture_sizes(max_size), max_blocks=max_blocks,
                                   device=self.device, backend=backend or CudaGraphBackend())
        self.graphs.capture()
        return self.graphs

    def recapture_decode_graphs(self) -> None:
        """Capture again, as before, after the pool or the weights were replaced (a wake-up)."""
        if self._graph_args is not None and self.graphs is None:
            self.capture_decode_graphs(**self._graph_args)

    def release_kv_cache(self) -> None:
        """Give the KV pool's memory back (a sleep): on CPU its pages go back to the
        kernel (``MADV_DONTNEED``; the mapping stays, and reads as zeros until written);
        on a GPU the tensor is freed. The pool's contents are gone either way, and so are
        captured decode graphs (they point at the old pool and weights;
        :meth:`recapture_decode_graphs`)."""
        self._gather_buffers = None
        self.graphs = None
        if self.on_cpu:
            if self._kv_mapping is not None:
                self._kv_mapping.madvise(mmap.MADV_DONTNEED)
            if self.prefix_layouts is not None:
                self.prefix_layouts.release()
            return
        if self.kv_caches:
            first = self.kv_caches[0].paged
            self._released_kv = ((len(self.kv_caches), *first.shape), first.dtype)
            self.kv_caches = []

    def restore_kv_cache(self) -> None:
        """The pool usable again after :meth:`release_kv_cache` (zeroed on a GPU; on CPU
        the pages come back, zero, as the next steps write them)."""
        if not self.on_cpu and self._released_kv is not None:
            shape, dtype = self._released_kv
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches = [LayerKV(layer) for layer in cache.unbind(0)]
            self._released_kv = None

    def _gather_buffers_for(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for gathering ``num_blocks`` blocks of one layer; grows, never shrinks."""
        numel = gather_numel(num_blocks, self.kv_caches[0].paged)
        if self._gather_buffers is None or self._gather_buffers[0].numel() < numel:
            numel = max(numel, 2 * (0 if self._gather_buffers is None else self._gather_buffers[0].numel()))
            dtype = self.kv_caches[0].paged.dtype
            self._gather_buffers = (torch.empty(numel, dtype=dtype, device=self.device),
                                    torch.empty(numel, dtype=dtype, device=self.device))
        return self._gather_buffers

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.freed_req_ids:
            self.requests.pop(req_id, None)
            if self.staging is not None:
                self.staging.release(req_id)
        for new in sched.new_requests:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, new.stop_token_ids,
            )
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:  # pipeline stages: what the last stage sampled, for the others
                start = cached.num_computed_tokens
                state.token_ids[start : start + len(cached.new_token_ids)] = cached.new_token_ids

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return RunnerOutput([], [], {}, {})
        bs = self.block_size
        scheduled = [(self.requests[rid], n) for rid, n in sched.num_scheduled_tokens.items()]
        # Decode rows (one token) first, then prefill chunks: attention handles each
        # group its own way.
        scheduled.sort(key=lambda item: item[1] != 1)
        num_decode = sum(1 for _, n in scheduled if n == 1)
        staged_rows = None
        if num_decode and self.staging is not None:
            decode = scheduled[:num_decode]
            rows = self.staging.prepare(
                [(s.req_id, s.block_ids, s.num_computed_tokens) for s, _ in decode],
                [layer.paged for layer in self.kv_caches], bs,
            )
            order = sorted(range(num_decode), key=rows.__getitem__)
            scheduled[:num_decode] = [decode[i] for i in order]
            staged_rows = [rows[i] for i in order]
            for layer, keys, values in zip(self.kv_caches, self.staging.keys, self.staging.values):
                layer.staged_keys, layer.staged_values = keys, values

        input_ids: list[int] = []
        positions: list[int] = []
        row_of_token: list[int] = []
        starts: list[int] = []
        for row, (state, n) in enumerate(scheduled):
            start = state.num_computed_tokens
            starts.append(len(input_ids))
            input_ids.extend(state.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            row_of_token.extend([row] * n)
        max_blocks = max(len(state.block_ids) for state, _ in scheduled)
        table = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        for row, (state, _) in enumerate(scheduled):
            table[row, : len(state.block_ids)] = state.block_ids
        block_table = torch.from_numpy(table)
        pos_np = np.fromiter(positions, dtype=np.int64, count=len(positions))
        row_np = np.fromiter(row_of_token, dtype=np.int64, count=len(row_of_token))
        slots = table[row_np, pos_np // bs] * bs + pos_np % bs
        pos_t, slot_mapping = torch.from_numpy(pos_np), torch.from_numpy(slots)
        if self.prefix_layouts is not None:
            self.prefix_layouts.written(slots, bs)

        decode_table = decode_mask = decode_rows = decode_write_index = seq_lens = None
        prefix_blocks = 0  # leading blocks every decode row shares (the C kernel's shared prefix)
        length = 0  # keys each decode row's SDPA reads (not used by the kernel)
        gathered = 0  # blocks the decode rows gather per layer
        if num_decode:
            lens = np.fromiter((scheduled[r][0].num_computed_tokens + 1 for r in range(num_decode)), np.int64, num_decode)
            seq_lens = torch.from_numpy(lens)
            if self.decode_prefix and num_decode > 1:
                prefix_blocks = shared_prefix_blocks(table[:num_decode], lens, bs)
            if self.decode_kernel is not None or self.triton_attention:  # read the paged cache in place
                decode_table = block_table[:num_decode]
            elif staged_rows is not None:
                length = int(seq_lens.max())
                assert self.staging is not None
                decode_rows = torch.tensor(staged_rows)
                decode_write_index = self.staging.write_index(staged_rows, (seq_lens - 1).tolist())
            else:
                num_blocks = -(-int(seq_lens.max()) // bs)
                length = num_blocks * bs
                decode_table = block_table[:num_decode, :num_blocks]
                gathered = decode_table.numel()
            if decode_table is None:  # the masked path (sliding windows, soft-capping) reads the blocks itself
                decode_table = block_table[:num_decode]
            if int(seq_lens.min()) < length:
                masked = torch.arange(length).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [Nd, L]
                decode_mask = torch.zeros(masked.shape, dtype=self.model_dtype).masked_fill_(masked, float("-inf"))[:, None, None, :]
        if self.prefix_layouts is not None:  # this step's slots for the prefix's kept layouts
            slots = self.prefix_layouts.for_step(table[0, :prefix_blocks], bs) if prefix_blocks else None
            for i, layer in enumerate(self.kv_caches):
                layer.prefix_slot = None if slots is None else slots[i]
        input_t = _long_tensor(input_ids)
        if self.graphs is not None and num_decode == len(scheduled) and self.pp is None:
            assert decode_table is not None and seq_lens is not None
            # From the host tensors: the graphs' own buffers take them in one copy.
            hidden = self.graphs.run(input_t, pos_t, slot_mapping, decode_table, seq_lens)  # None: no bucket fits
            if hidden is not None:
                return self._sample(scheduled, starts, hidden, sched.masks_follow)
        if not self.on_cpu:
            # Everything the forward pass indexes with goes to the device once, here, in
            # one copy (the decode rows' table is the first rows of the block table's).
            assert self.step_inputs is not None
            input_t, pos_t, slot_mapping, block_table, seq_lens = self.step_inputs.send(
                [input_t, pos_t, slot_mapping, block_table, seq_lens])
            if decode_table is not None:
                decode_table = block_table[:num_decode, : decode_table.shape[1]]
            if decode_mask is not None:
                decode_mask = decode_mask.to(self.device)
        prefills = []
        for row in range(num_decode, len(scheduled)):
            state, n = scheduled[row]
            ctx = state.num_computed_tokens
            # Blocks of the context and the chunk; the Triton kernel reads a chunk's own
            # keys from the cache too, so it gets them for every chunk.
            chunk_blocks = block_table[row, : -(-(ctx + n) // bs)] if ctx or self.triton_attention else None
            prefills.append(PrefillChunk(starts[row], starts[row] + n, ctx, chunk_blocks))
        gathered = max([gathered] + [p.block_ids.numel() for p in prefills if p.block_ids is not None])
        buffers = self._gather_buffers_for(gathered) if gathered else None
        meta = AttentionMetadata(
            slot_mapping, num_decode, decode_table, decode_mask, tuple(prefills), buffers,
            decode_rows=decode_rows, decode_write_index=decode_write_index,
            decode_rows_packed=staged_rows is not None and staged_rows == list(range(num_decode)),
            decode_len=length, decode_kernel=self.decode_kernel, decode_seq_lens=seq_lens,
            decode_prefix_blocks=prefix_blocks,
            prefill_kernel=self.prefill_kernel, kv_writer=self.kv_writer, triton=self.triton_attention,
            layer_done=self.layer_done,
        )

        if self.pp is not None:
            return self._pipeline_step(scheduled, starts, input_t, pos_t, meta, sched.masks_follow)
        output_rows = self._output_rows(scheduled, starts, len(input_ids))
        hidden = self.model(input_t, pos_t, self.kv_caches, meta, output_rows=output_rows)  # [T or rows, hidden]
        return self._sample(scheduled, starts, hidden, sched.masks_follow)

    def _output_rows(self, scheduled: list[tuple[CachedRequestState, int]], starts: list[int],
                     num_tokens: int) -> torch.Tensor | None:
        """The tokens whose final hidden states this step reads, when that is not all of
        them: each sampling row's last token, in row order (what :meth:`_sample` takes),
        so the model's last layer skips the rest. None when every token is read (decode
        rows only) or when a request in the step asks for prompt logprobs (every
        prompt position's logits). A step where no row samples (chunks of prompts
        only) keeps its last token, so no kernel sees zero rows."""
        if any(state.params.prompt_logprobs is not None for state, _ in scheduled):
            return None
        rows = [starts[r] + scheduled[r][1] - 1 for r in _sampling_rows(scheduled)]
        if len(rows) == num_tokens:
            return None
        return _long_tensor(rows or [num_tokens - 1]).to(self.device)

    def _pipeline_step(self, scheduled: list[tuple[CachedRequestState, int]], starts: list[int], input_t: torch.Tensor,
                       pos_t: torch.Tensor, meta: AttentionMetadata, masks_follow: bool) -> RunnerOutput:
        """This stage's part of the step: the previous stage's hidden states in (after
        the first), this stage's layers, then the hidden states out (before the last) or
        the sampling (the last). A stage before the last is done with the step once its
        send is under way, and takes the next one: it learns the sampled tokens from
        the steps that schedule them (``new_token_ids``)."""
        pp = self.pp
        assert pp is not None
        intermediate = None
        if not pp.is_first:
            intermediate = pp.recv(input_t.shape[0], self.model.cfg.hidden_size, self.model_dtype, self.device)
        output_rows = self._output_rows(scheduled, starts, input_t.shape[0]) if pp.is_last else None
        out = self.model(input_t, pos_t, self.kv_caches, meta, intermediate, output_rows)
        if pp.is_last:
            return self._sample(scheduled, starts, out, masks_follow)
        pp.send(*out)
        return RunnerOutput([], [], {}, {})  # only the last stage's output rank replies

    def _sample(self, scheduled: list[tuple[CachedRequestState, int]], starts: list[int],
                hidden: torch.Tensor, masks_follow: bool) -> RunnerOutput:
        """Logits and tokens for the rows that reach the end of their known tokens, and
        the prompt logprobs asked for; ``masks_follow``: the step's grammar masks are to
        be read (whether or not a constrained row samples now)."""
        sample_rows = _sampling_rows(scheduled)
        sample_ids = [scheduled[r][0].req_id for r in sample_rows]
        prompt_logprobs = self._prompt_logprobs(scheduled, starts, hidden)
        if not sample_rows:
            if masks_follow:
                self._read_masks()  # read all the same: the next step's come after them
            return RunnerOutput([], [], {}, prompt_logprobs)
        if len(sample_rows) == hidden.shape[0]:  # every row samples its only token, or hidden holds those rows alone
            logits = self.model.compute_logits(hidden)  # [N, vocab], sampled where they are
        else:
            last_token = _long_tensor([starts[r] + scheduled[r][1] - 1 for r in sample_rows]).to(self.device)
            logits = self.model.compute_logits(hidden[last_token])
        rows = [scheduled[r][0] for r in sample_rows]
        # Read as late as can be: the engine core computes them while this step runs.
        allowed = _allowed(self._read_masks(), sample_ids) if masks_follow else None
        tokens, logprobs = self.sampler(
            logits, [SamplingRow(s.params, s.token_ids, s.num_prompt_tokens, s.stop_token_ids) for s in rows], allowed
        )
        for state, token in zip(rows, tokens):
            state.token_ids.append(token)
        return RunnerOutput(
            sample_ids, tokens, {rid: lp for rid, lp in zip(sample_ids, logprobs) if lp is not None}, prompt_logprobs
        )

    @property
    def samples(self) -> bool:
        """Whether this rank samples (every rank but those of a stage before the last)."""
        return self.pp is None or self.pp.is_last

    def _read_masks(self) -> GrammarMasks:
        if self.fetch_masks is None:
            raise RuntimeError("a step with grammar masks reached a model runner that cannot read them")
        return self.fetch_masks()

    def _prompt_logprobs(self, scheduled: list[tuple[CachedRequestState, int]], starts: list[int], hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens this step computed, for requests that asked.

        The hidden state at position p predicts the token at p + 1, so a chunk covering
        positions [a, b) yields the logprobs of prompt tokens a + 1 .. b (within the prompt).
        """
        out: dict[str, list[TokenLogprobs]] = {}
        for row, (state, n) in enumerate(scheduled):
            top_n = state.params.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)
            if top_n is None or end <= start:
                continue
            lp = torch.log_softmax(self.model.compute_logits(hidden[starts[row] : starts[row] + end - start]).float(),
                                   dim=-1)
            out[state.req_id] = batched_logprobs(lp, state.token_ids[start + 1 : end + 1], [top_n] * (end - start))
        return out
