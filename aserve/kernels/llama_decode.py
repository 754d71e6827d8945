"""A decode step through every decoder layer of a Llama-family model in one C call
(two a layer on a tensor-parallel rank, all-reduced between), for Llama, Mistral, Qwen2
and Qwen3 layers in one of two forms:

- bf16 with every linear layer on AMX (``cpu_llama_decode.c``, :func:`load`), or on the
  AVX512-BF16 kernel of :mod:`aserve.kernels.bf16_linear` where the CPU has no AMX
  (``cpu_llama_decode_avx512.c``; the same packed weights);
- float32 with every linear layer on the kernel of :mod:`aserve.kernels.f32_linear`
  (its AVX-512 or AVX2 form; ``cpu_llama_decode_f32.c``, :func:`load_float32`), the
  form float32 weights take on an x86 CPU with AVX2.

On a small model the per-layer Python between the kernels (module calls, views, output
tensors, ctypes conversions) cost about a third of a decode step; this calls the same
kernels in the same order from C, so its results are bit-identical to the layer-by-layer
path. The model decides when it applies (:meth:`aserve.model.models.llama.LlamaModel.
attach_decode_stack`); this module only describes the layers to the C side and keeps
the step's scratch memory.

All share their C body (``cpu_llama_decode_body.h``). :func:`load` returns None where the
library cannot be built, the CPU has neither AMX nor AVX512-BF16 (or they are switched
off), or ``ASERVE_CPU_FUSED_DECODE=0``;
:func:`load_float32` where it cannot be built, the float32 linear kernel does not apply to
this CPU (:func:`aserve.kernels.f32_linear.cpu_supported`), or the same switches.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from aserve.envs import read_env
from aserve.kernels.amx_linear import load_amx_library
from aserve.kernels.bf16_linear import load_library_checked as load_bf16_library
from aserve.kernels.cbuild import build_ahead, load_library
from aserve.kernels.cpu_decode_attention import PrefixSlot, prefix_layout_bytes
from aserve.kernels.f32_linear import cpu_supported as f32_cpu_supported

_SOURCE = Path(__file__).with_name("cpu_llama_decode.c")
_F32_SOURCE = Path(__file__).with_name("cpu_llama_decode_f32.c")
_AVX512_SOURCE = Path(__file__).with_name("cpu_llama_decode_avx512.c")
_ALIGN = 32  # elements: each scratch region starts on a 64-byte line (or two)


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "w_qkv", "w_o", "w_gate_up", "w_down", "qkv_bias", "q_norm", "k_norm",
                 "k_cache", "v_cache")]


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("hidden", "Hq", "Hk", "D", "inter", "qkv_width", "o_width", "gate_up_width", "down_width",
                 "block_size", "kv_stride_block", "kv_stride_token", "kv_stride_head", "kv_bf16")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("qk_eps", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("x_in", "x", "residual", "h", "qkv", "attn", "o", "gate_up", "act", "cos", "sin",
                 "block_table", "seq_lens")] + [
        ("B", ctypes.c_int64), ("max_blocks", ctypes.c_int64), ("prefix_blocks", ctypes.c_int64),
        ("prefix_layouts", ctypes.c_void_p), ("prefix_states", ctypes.c_void_p), ("num_threads", ctypes.c_int)]


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer as the C side reads it: the two norm weights ([hidden]), the
    four linear weights (bf16: packed by ``AmxLinear.pack``; float32: packed by
    ``F32Linear.pack``), the q/k/v bias (Qwen2) and the per-head q and k norm weights
    ([head_dim], Qwen3) if any."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class StackDims:
    """Sizes every layer shares. Widths are the linear outputs' row lengths (AMX: ``out``
    rounded up to 32; float32: ``out``)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    qkv_width: int
    o_width: int
    gate_up_width: int
    down_width: int
    eps: float
    scale: float
    qk_eps: float = 0.0  # the per-head q/k norms' epsilon (Qwen3)


class DecodeStack:
    """The layers of one model, ready to run decode steps: :meth:`run`.

    With ``all_reduce`` (a tensor-parallel rank's in-place sum over its group) each layer
    runs as two C calls, and o_proj's and down_proj's outputs are summed between them,
    where the layer-by-layer path sums them; their widths must then equal ``hidden``."""

    def __init__(self, fn: ctypes._CFuncPtr, half: ctypes._CFuncPtr, layers: list[LayerTensors], dims: StackDims,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self._fn, self._half = fn, half
        self.dtype = dtype
        self._layers = layers  # the tensors, so their memory outlives the pointers below
        self.dims = dims
        self._all_reduce = all_reduce
        self._c_layers: ctypes.Array | None = None
        self._c_dims: _Dims | None = None
        self._kv_key: tuple[int, ...] = ()
        self._scratch = torch.empty(0, dtype=dtype)

    def _bind_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Layer and size structures for these caches ([2, blocks, block_size, Hk, D]
        each); rebuilt only when the caches change."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if key == self._kv_key:
            return
        d = self.dims
        arr = (_LayerWeights * len(self._layers))()
        for slot, layer, cache in zip(arr, self._layers, kv_caches):
            slot.input_norm, slot.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            slot.w_qkv, slot.w_o = layer.w_qkv.data_ptr(), layer.w_o.data_ptr()
            slot.w_gate_up, slot.w_down = layer.w_gate_up.data_ptr(), layer.w_down.data_ptr()
            slot.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            slot.q_norm = None if layer.q_norm is None else layer.q_norm.data_ptr()
            slot.k_norm = None if layer.k_norm is None else layer.k_norm.data_ptr()
            slot.k_cache, slot.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        stride = kv_caches[0][0].stride()
        self._c_dims = _Dims(d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate, d.qkv_width,
                             d.o_width, d.gate_up_width, d.down_width, kv_caches[0].shape[2], stride[0], stride[1],
                             stride[2], int(kv_caches[0].dtype == torch.bfloat16), d.eps, d.scale, d.qk_eps)
        self._c_layers, self._kv_key = arr, key

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
            block_table: torch.Tensor, seq_lens: torch.Tensor, prefix_blocks: int = 0,
            prefix_slots: Sequence[PrefixSlot | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer for ``x`` ([B, hidden] embeddings in the stack's dtype, one decode
        token per row):
        ``(last layer's output, residual)``, views of scratch memory that the next call
        overwrites. ``cos`` / ``sin``: [B, head_dim / 2] contiguous; ``block_table``:
        int64 [B, max_blocks] contiguous; ``seq_lens``: int64 [B], the new token
        included; ``prefix_blocks``: leading columns of ``block_table`` that are the same
        in every row, each row's context reaching past them (decode attention's shared
        prefix, :func:`aserve.kernels.cpu_decode_attention.shared_prefix_blocks`);
        ``prefix_slots``: per layer, where decode attention keeps that prefix's layouts
        between steps (:class:`aserve.kernels.cpu_decode_attention.PrefixLayouts`), or
        None. Writes this step's keys and values into ``kv_caches``."""
        self._bind_kv(kv_caches)
        d = self.dims
        rows = x.shape[0]
        sizes = [d.down_width, d.hidden, d.hidden, d.qkv_width, d.num_heads * d.head_dim, d.o_width,
                 d.gate_up_width, d.intermediate]
        spans = [-(-rows * n // _ALIGN) * _ALIGN for n in sizes]
        if self._scratch.numel() < sum(spans):
            self._scratch = torch.empty(sum(spans), dtype=self.dtype)
        base, offsets, at = self._scratch.data_ptr(), [], 0
        elem = self._scratch.element_size()
        for span in spans:
            offsets.append(base + elem * at)
            at += span
        layouts = states = None
        if prefix_blocks and prefix_slots is not None and all(slot is not None for slot in prefix_slots):
            n = len(prefix_slots)
            need = prefix_layout_bytes(prefix_blocks * kv_caches[0].shape[2], d.num_kv_heads, d.head_dim)
            if n != len(self._layers) or any(slot[0].numel() < need or slot[1].numel() != 1 for slot in prefix_slots):
                raise ValueError(f"prefix_slots: one per layer, each buffer at least {need} bytes")
            layouts = (ctypes.c_void_p * n)(*(slot[0].data_ptr() for slot in prefix_slots))
            states = (ctypes.c_void_p * n)(*(slot[1].data_ptr() for slot in prefix_slots))
        step = _Step(x.data_ptr(), *offsets, cos.data_ptr(), sin.data_ptr(), block_table.data_ptr(),
                     seq_lens.data_ptr(), rows, block_table.shape[1], prefix_blocks,
                     ctypes.cast(layouts, ctypes.c_void_p) if layouts is not None else None,
                     ctypes.cast(states, ctypes.c_void_p) if states is not None else None, torch.get_num_threads())
        dims_ref, step_ref = ctypes.byref(self._c_dims), ctypes.byref(step)
        if self._all_reduce is None:
            rc = self._fn(self._c_layers, len(self._layers), dims_ref, step_ref)
        else:
            # o (region 5) and x (region 0) are [rows, hidden], contiguous (checked in stack()).
            o_start = sum(spans[:5])
            o_sum = self._scratch[o_start : o_start + rows * d.hidden]
            x_sum = self._scratch[: rows * d.hidden]
            rc, n = 0, len(self._layers)
            for i in range(n):
                rc = self._half(self._c_layers, n, i, 0, dims_ref, step_ref)
                if rc:
                    break
                self._all_reduce(o_sum)
                rc = self._half(self._c_layers, n, i, 1, dims_ref, step_ref)
                if rc:
                    break
                self._all_reduce(x_sum)
        if rc != 0:
            raise ValueError(f"fused decode step: a kernel refused the shapes {d} (rows {rows})")
        out = self._scratch[: rows * d.down_width].view(rows, d.down_width)[:, : d.hidden]
        residual = self._scratch[spans[0] : spans[0] + rows * d.hidden].view(rows, d.hidden)
        return out, residual


class LlamaDecodeKernel:
    """The loaded library: :meth:`stack` describes a model's layers once."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        """``dtype``: the weights' and activations' (bf16: the AMX library; float32: the
        AVX2 one)."""
        self.dtype = dtype
        self._fn = lib.aserve_llama_decode
        self._fn.argtypes = [ctypes.POINTER(_LayerWeights), ctypes.c_int64, ctypes.POINTER(_Dims),
                             ctypes.POINTER(_Step)]
        self._fn.restype = ctypes.c_int
        self._half = lib.aserve_llama_decode_half
        self._half.argtypes = [ctypes.POINTER(_LayerWeights), ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.POINTER(_Dims), ctypes.POINTER(_Step)]
        self._half.restype = ctypes.c_int

    def stack(self, layers: list[LayerTensors], dims: StackDims,
              all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DecodeStack:
        """The stack of ``layers``; ``all_reduce`` for a layer split between tensor-parallel
        ranks (see :class:`DecodeStack`). Raises ValueError for weights it cannot take."""
        if all_reduce is not None and not dims.o_width == dims.down_width == dims.hidden:
            raise ValueError("a tensor-parallel decode stack needs a hidden size that is a multiple of 32")
        for layer in layers:
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError("pass both per-head norms, or neither")
            for t in (layer.input_norm, layer.post_norm, layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down,
                      layer.qkv_bias, layer.q_norm, layer.k_norm):
                if t is not None and (t.dtype != self.dtype or not t.is_contiguous()):
                    raise ValueError(f"this fused decode step takes contiguous {self.dtype} weights")
        return DecodeStack(self._fn, self._half, layers, dims, all_reduce, dtype=self.dtype)


def load(kind: str | None = None) -> LlamaDecodeKernel | None:
    """The bf16 library over the linear kernel ``kind`` (``"amx"`` or ``"avx512_bf16"``,
    the :class:`~aserve.kernels.amx_linear.AmxLinear` the layers were packed for; None:
    the one :func:`aserve.kernels.bf16_linear.load_best` would pick), or None where it is
    unavailable or switched off."""
    env = read_env()
    if not env.cpu_fused_decode or not env.cpu_fused_ops or env.cpu_attention == "sdpa":
        return None
    if kind in (None, "amx") and env.cpu_amx:
        lib = load_amx_library(_SOURCE, env.cache_dir / "kernels", "the fused decode step")
        if lib is not None or kind == "amx":
            return None if lib is None else LlamaDecodeKernel(lib)
    if kind in (None, "avx512_bf16") and env.cpu_bf16_linear:
        lib = load_bf16_library(_AVX512_SOURCE, "the fused decode step (AVX512-BF16)")
        return None if lib is None else LlamaDecodeKernel(lib)
    return None


def _float32_wanted() -> bool:
    env = read_env()
    return (env.cpu_fused_decode and env.cpu_fused_ops and env.cpu_f32_linear and env.cpu_attention != "sdpa"
            and f32_cpu_supported())


def build_float32() -> None:
    """Compile the library :func:`load_float32` loads, unless it would return None before
    building (a worker runs this on a thread while it loads the model)."""
    if _float32_wanted():
        build_ahead(_F32_SOURCE, read_env().cache_dir / "kernels")


def load_float32() -> LlamaDecodeKernel | None:
    """The float32 library, or None where it is unavailable or switched off."""
    env = read_env()
    if not _float32_wanted():
        return None
    lib = load_library(_F32_SOURCE, env.cache_dir / "kernels", "the float32 fused decode step",
                       available="aserve_f32_linear_available")
    return None if lib is None else LlamaDecodeKernel(lib, torch.float32)
