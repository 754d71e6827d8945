"""Tensor-parallel linear layers (Megatron style), each loading its own shard.

Column-parallel layers split the output features over ranks and need no communication;
row-parallel layers split the input features and all-reduce their partial sums. A
column-parallel layer feeding a row-parallel one (QKV -> o_proj, gate_up -> down) costs
one all-reduce per pair.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.tp_group import TPGroup
from aserve.kernels.amx_linear import AmxLinear, huge_page_arena
from aserve.kernels.f32_linear import F32Linear
from aserve.model.layers.weights import TensorSource, check_shape, expect_full_shape, new_param


def _cpu_linear_packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of ``dtype`` (and gives F.linear's result)."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        x = torch.ones(2, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w)))
    except (RuntimeError, AttributeError):
        return False


class PackedMatmul:
    """``x W^T``: ``F.linear`` until :func:`prepack_linears` picks a faster form for
    CPU: bf16 on AMX tiles (:mod:`aserve.kernels.amx_linear`; on a CPU with AVX512-BF16 and
    no AMX the same tiled copy on :mod:`aserve.kernels.bf16_linear`), oneDNN on a prepacked
    weight (about 1.5x faster than ``F.linear`` at decode batch sizes, where
    ``F.linear`` would reorder a bf16 weight into oneDNN's blocked layout on every
    call), or, for float32 weights, the AVX2 kernel of :mod:`aserve.kernels.f32_linear`
    on a packed copy (where it is unavailable, oneDNN for large float32 weights and MKL
    on a transposed copy for small ones).

    Mixed into the linear layers and the LM head; the class it is mixed into provides
    ``weight`` ([out, in]). A bias is the caller's to pass."""

    weight: nn.Parameter
    amx: AmxLinear | None = None
    amx_weight: torch.Tensor | None = None  # the tiled copy amx.pack made
    f32: F32Linear | None = None
    f32_weight: torch.Tensor | None = None  # the panel copy f32.pack made
    out_rows: int = 0  # output features, kept once the plain weight is dropped
    packed_weight: torch.Tensor | None = None
    transposed_weight: torch.Tensor | None = None  # [in, out], contiguous
    keep_plain_weight = False  # set by prepack_linears when another module shares the weight

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.amx is not None:
            # x is [T, in]: the model flattens its batch to tokens.
            return self.amx.linear(x, self.amx_weight, self.out_rows, bias)
        if self.f32 is not None:
            return self.f32.linear(x, self.f32_weight, self.out_rows, bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        if self.transposed_weight is not None:
            # x is [T, in]: the model flattens its batch to tokens.
            return torch.mm(x, self.transposed_weight) if bias is None else torch.addmm(bias, x, self.transposed_weight)
        return F.linear(x, self.weight, bias)

    def use_amx(self, amx: AmxLinear, out: torch.Tensor | None = None) -> None:
        self.amx, self.out_rows = amx, self.weight.shape[0]
        self.amx_weight = amx.pack(self.weight.data, out)
        self._drop_plain_weight()

    def use_f32(self, f32: F32Linear) -> None:
        self.f32, self.out_rows = f32, self.weight.shape[0]
        self.f32_weight = f32.pack(self.weight.data)
        self._drop_plain_weight()

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)
        self._drop_plain_weight()

    def transpose(self) -> None:
        self.transposed_weight = self.weight.data.t().contiguous()
        self._drop_plain_weight()

    def _drop_plain_weight(self) -> None:
        if self.keep_plain_weight:  # another module reads it (a tied embedding)
            return
        # The plain copy is no longer read: keep the parameter (for its name) but free it.
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)


class _Linear(PackedMatmul, nn.Module):
    """Base of the tensor-parallel linear layers."""

    bias: nn.Parameter | None


def prepack_linears(model: nn.Module, amx: AmxLinear | None = None, f32: F32Linear | None = None) -> int:
    """Give every tensor-parallel linear of a CPU model, and its LM head, its fastest
    weight layout; returns how many layers it saw.

    bf16 weights whose input side is a multiple of 32 go to ``amx`` when given (the
    output side is padded to 32); float32 weights go to ``f32`` when given; other large
    weights (and every other bf16 one) are prepacked for oneDNN where oneDNN can, and
    small float32 ones stored transposed for MKL (see :func:`_packing_pays`). A weight another module also uses (an LM head
    tied to the embedding) gets its fast copy too but keeps the plain one the other
    module reads, as vLLM's CPU backend does for every LM head: a second copy of the
    head (vocabulary x hidden) buys a faster step (a 151,936 x 1,024 bf16 head, two
    threads, one row: 17.3 ms through ``F.linear``, 12.0 ms on AMX). Call it after the
    weights are loaded: changed layers no longer accept weight loading.
    """
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    layers = [m for m in model.modules() if isinstance(m, PackedMatmul)]
    if not layers or layers[0].weight.device.type != "cpu":
        return 0
    for layer in layers:
        layer.keep_plain_weight = uses.get(id(layer.weight), 1) > 1
    can_pack = _cpu_linear_packing_works(layers[0].weight.dtype)
    tiled = [layer for layer in layers if amx is not None and amx.supports(layer.weight)]
    if amx is not None and tiled:
        # One huge-page arena for every tiled weight (see huge_page_arena); sides that
        # are (padded to) multiples of 32 start each weight 2 KiB-aligned.
        arena = huge_page_arena(sum(amx.packed_numel(layer.weight) for layer in tiled))
        offset = 0
        for layer in tiled:
            numel = amx.packed_numel(layer.weight)
            layer.use_amx(amx, arena[offset : offset + numel])
            offset += numel
    for module in model.modules():
        if hasattr(module, "pack_weights"):  # a MoE layer's experts (aserve.model.layers.moe)
            module.pack_weights(amx, f32, can_pack)
    for layer in layers:
        if layer.amx is not None:
            continue
        if f32 is not None and f32.supports(layer.weight):
            layer.use_f32(f32)
        elif can_pack and _packing_pays(layer.weight):
            layer.prepack()
        else:
            layer.transpose()
    return len(layers)


#: fp32 weights smaller than this are not prepacked (see _packing_pays).
FP32_PACK_MIN_ELEMENTS = 1 << 20


def _packing_pays(weight: torch.Tensor) -> bool:
    """bf16: always (F.linear reorders a bf16 weight on every call: 1.2-1.6x slower at
    every size measured). fp32: only large weights. MKL's sgemm serves small fp32 ones
    faster than oneDNN's call overhead allows, fastest on a transposed copy
    (``torch.mm(x, W^T)``): for the 7M model's [768 x 256] weight, 9 us at batch 1 and
    81 us at batch 32 against 15 / 98 us with ``F.linear`` and 28 / 106 us prepacked;
    while a [3072 x 1024] weight of the 152M model is 1.15-1.36x faster prepacked at
    batch 32 (one or two threads, this VM)."""
    return weight.dtype != torch.float32 or weight.numel() >= FP32_PACK_MIN_ELEMENTS


class ColumnParallelLinear(_Linear):
    """``y = x W^T + b`` with W's rows (output features) split over ranks.

    ``output_sizes`` lists the logical outputs stacked in this layer (for example
    ``[intermediate, intermediate]`` for gate and up); each is split over ranks
    separately, and its shard id is its index in the list.
    """

    def __init__(self, in_features: int, output_sizes: list[int], *, bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.local_sizes = [size // tp.size for size in output_sizes]
        for size in output_sizes:
            tp.shard(size, "output features")
        total = sum(self.local_sizes)
        self.weight = new_param(total, in_features, dtype=dtype, loader=self._load)
        self.bias = new_param(total, dtype=dtype, loader=self._load) if bias else None

    def _part_range(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in this rank's param, rows, offset in the full tensor) of a part."""
        index = 0 if shard_id is None else int(shard_id)
        offset = sum(self.local_sizes[:index])
        rows = self.local_sizes[index]
        return offset, rows, self.tp.rank * rows

    def _full_part_shape(self, shard_id: Any, rows: int, ndim: int) -> tuple[int, ...]:
        full_rows = rows * self.tp.size
        return (full_rows, self.in_features) if ndim == 2 else (full_rows,)

    def _load(self, param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
        if shard_id == "fused":
            self._load_fused(param, source)
            return
        offset, rows, start = self._part_range(shard_id)
        expect_full_shape(source, self._full_part_shape(shard_id, rows, param.dim()))
        loaded = source.read(slice(start, start + rows))
        target = param.data.narrow(0, offset, rows)
        check_shape(target, loaded, source.name)
        target.copy_(loaded)

    def _part_ids(self) -> list[Any]:
        return list(range(len(self.local_sizes)))

    def _load_fused(self, param: torch.Tensor, source: TensorSource) -> None:
        """A checkpoint that stores this layer's parts as one tensor, stacked in order
        (Phi-3's ``qkv_proj`` and ``gate_up_proj``): each part's rows for this rank."""
        parts = self._part_ids()
        full = [self._full_part_shape(part, self._part_range(part)[1], param.dim())[0] for part in parts]
        expect_full_shape(source, (sum(full), self.in_features) if param.dim() == 2 else (sum(full),))
        base = 0
        for part, full_rows in zip(parts, full):
            offset, rows, start = self._part_range(part)
            loaded = source.read(slice(base + start, base + start + rows))
            target = param.data.narrow(0, offset, rows)
            check_shape(target, loaded, source.name)
            target.copy_(loaded)
            base += full_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, split by heads.

    With more ranks than KV heads, each KV head is replicated on ``tp / num_kv_heads``
    ranks: rank r holds KV head ``r // (tp / num_kv_heads)``.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        tp.shard(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            tp.shard(num_kv_heads, "key/value heads")
            self.num_local_kv_heads = num_kv_heads // tp.size
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor parallel size {tp.size} must be a multiple of {num_kv_heads} KV heads")
            self.num_local_kv_heads = 1
        self.num_local_heads = num_heads // tp.size
        self.head_dim = head_dim
        # Ranks that hold each KV head (more ranks than KV heads replicate them).
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self._num_kv_heads = num_kv_heads
        q, kv = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        super().__init__(hidden, [q * tp.size, kv * tp.size, kv * tp.size], bias=bias, tp=tp, dtype=dtype)

    def _full_part_shape(self, shard_id: Any, rows: int, ndim: int) -> tuple[int, ...]:
        full_rows = rows * self.tp.size if shard_id == "q" else self._num_kv_heads * self.head_dim
        return (full_rows, self.in_features) if ndim == 2 else (full_rows,)

    def _part_ids(self) -> list[Any]:
        return ["q", "k", "v"]

    def _part_range(self, shard_id: Any) -> tuple[int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        offset = sum(self.local_sizes[:index])
        rows = self.local_sizes[index]
        rank = self.tp.rank if index == 0 else self.tp.rank // self.kv_replicas
        return offset, rows, rank * rows


class RowParallelLinear(_Linear):
    """``y = all_reduce(x_local W_local^T) + b`` with W's columns split over ranks.

    The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 reduce: bool = True) -> None:
        """``reduce=False`` returns this rank's partial sum, for a caller that adds it to
        others before one all-reduce (a MoE layer's shared expert)."""
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        start, end = tp.shard(in_features, "input features")
        self._cols = (start, end)
        self._full_shape = (out_features, in_features)
        self.weight = new_param(out_features, end - start, dtype=dtype, loader=self._load)
        self.bias = new_param(out_features, dtype=dtype) if bias else None

    def _load(self, param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
        expect_full_shape(source, self._full_shape)
        loaded = source.read(slice(None), slice(*self._cols))
        check_shape(param, loaded, source.name)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
