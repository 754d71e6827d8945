"""Mixture-of-experts MLP: a softmax router, top-k experts per token, the experts'
SwiGLU (or GeGLU) computed grouped by expert.

Routing follows each config as transformers computes it: the router's logits in the
model's dtype, a float32 softmax over all experts, the top k, renormalised to sum to one
when ``norm_topk_prob`` says so (Mixtral always), and the weights back in the model's
dtype (Mixtral keeps them in float32).

The experts' compute: the step's (token, expert) pairs are sorted by expert, each expert
multiplies its tokens' rows in one matmul pair (gate and up, then down), and the
weighted rows are summed back into their tokens with one ``index_add_``. A step runs a
Python loop over the experts that received tokens, never over tokens.

Tensor parallelism: every rank holds a slice of every expert's intermediate dimension
(the gate and up rows, the down columns), so each rank's sum is a partial one and the
layer all-reduces once, after the shared expert's partial sum (Qwen2-MoE) is added in:
the shared expert's gate is a per-token scalar, so it commutes with the sum.

Checkpoint layouts: the Hub's one tensor per expert (``experts.E.gate_proj.weight``, or
Mixtral's ``w1``/``w3``/``w2``), and the stacked form newer transformers hold in memory
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); see
:func:`expert_param`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.tp_group import TPGroup
from aserve.kernels.cpu_fused_ops import FusedOps
from aserve.model.hf_config import MoEConfig
from aserve.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from aserve.model.layers.weights import TensorSource, check_shape, expect_full_shape, new_param

_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
         "down_proj": ("w2", None), "w2": ("w2", None)}


def expert_param(name: str) -> tuple[str, Any] | None:
    """A checkpoint tensor of the experts -> (our parameter's name, shard id), or None
    when ``name`` is not one. Per-expert tensors get ``(expert, part)`` (part 0 gate, 1
    up) or ``(expert, None)``; the stacked ones ``"stacked"``."""
    match = _EXPERT.search(name)
    if match is not None:
        target, part = _PART[match.group(2)]
        return name[: match.start()] + f".experts.{target}", (int(match.group(1)), part)
    if name.endswith(".experts.gate_up_proj"):
        return name[: -len("gate_up_proj")] + "w13", "stacked"
    if name.endswith(".experts.down_proj"):
        return name[: -len("down_proj")] + "w2", "stacked"
    return None


def activation(name: str):  # noqa: ANN201 (a torch function)
    """The gated MLP's activation by its config name (``aserve.model.hf_config.ACTIVATIONS``)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class Experts(nn.Module):
    """Every expert's weights, this rank's slice of their intermediate dimension:
    ``w13`` [E, 2 * I_local, H] (gate rows, then up rows) and ``w2`` [E, H, I_local]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        start, end = tp.shard(intermediate, "expert intermediate size")
        self.cols = (start, end)
        local = end - start
        self.local = local
        self.w13 = new_param(num_experts, 2 * local, hidden, dtype=dtype, loader=self._load_w13)
        self.w2 = new_param(num_experts, hidden, local, dtype=dtype, loader=self._load_w2)
        # Each expert's two weights in a CPU kernel's form (pack_weights), and its product.
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._packed_mm: Any = None

    def pack_weights(self, amx: Any, f32: Any, onednn: bool) -> str | None:
        """Give every expert's weights the form the dense linear layers get
        (:func:`~aserve.model.layers.linear.prepack_linears`): bf16 on AMX tiles (or AVX512-BF16), float32
        in the AVX2 kernel's panels, else oneDNN's prepacked layout. A decode step reads
        every expert's weights once (32 tokens over 8 experts touch them all), so the
        step is bound by how fast they stream: on two AVX2 cores the 150M MoE's eight
        experts of a layer took 13.7 ms through MKL and 5.7 ms packed. Returns the form
        chosen (None: kept for ``torch.mm``); the plain weights are freed."""
        w13 = [self.w13.data[e] for e in range(self.num_experts)]
        w2 = [self.w2.data[e].contiguous() for e in range(self.num_experts)]
        if amx is not None and all(amx.supports(w) for w in w13 + w2):
            self.packed = ([amx.pack(w) for w in w13], [amx.pack(w) for w in w2])
            self._packed_mm, form = amx.linear, amx.kind
        elif f32 is not None and all(f32.supports(w) for w in w13 + w2):
            self.packed = ([f32.pack(w) for w in w13], [f32.pack(w) for w in w2])
            self._packed_mm, form = f32.linear, "f32"
        elif onednn:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self.packed = ([reorder(w) for w in w13], [reorder(w) for w in w2])
            self._packed_mm = lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            form = "onednn"
        else:
            return None
        self.w13.data = torch.empty(0, dtype=self.w13.dtype)
        self.w2.data = torch.empty(0, dtype=self.w2.dtype)
        return form

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """[n, H] -> [n, 2 * I_local]."""
        if self.packed is not None:
            return self._packed_mm(x, self.packed[0][expert], 2 * self.local)
        return torch.mm(x, self.w13[expert].t())

    def down(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """[n, I_local] -> [n, H]."""
        if self.packed is not None:
            return self._packed_mm(x, self.packed[1][expert], self.hidden)
        return torch.mm(x, self.w2[expert].t())

    def _load_w13(self, param: torch.Tensor, source: TensorSource, shard_id: Any) -> None:
        start, end = self.cols
        if shard_id == "stacked":
            expect_full_shape(source, (self.num_experts, 2 * self.intermediate, self.hidden))
            for part in (0, 1):
                off = part * self.intermediate
                loaded = source.read(slice(None), slice(off + start, off + end))
                target = param.data[:, part * self.local : (part + 1) * self.local]
                check_shape(target, loaded, source.name)
                target.copy_(loaded)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise _no_expert(source.name, expert, self.num_experts)
        expect_full_shape(source, (self.intermediate, self.hidden))
        loaded = source.read(slice(start, end))
        target = param.data[expert, part * self.local : (part + 1) * self.local]
        check_shape(target, loaded, source.name)
        target.copy_(loaded)

    def _load_w2(self, param: torch.Tensor, source: TensorSource, shard_id: Any) -> None:
        start, end = self.cols
        if shard_id == "stacked":
            expect_full_shape(source, (self.num_experts, self.hidden, self.intermediate))
            loaded = source.read(slice(None), slice(None), slice(start, end))
            check_shape(param.data, loaded, source.name)
            param.data.copy_(loaded)
            return
        expert, _ = shard_id
        if not 0 <= expert < self.num_experts:
            raise _no_expert(source.name, expert, self.num_experts)
        expect_full_shape(source, (self.hidden, self.intermediate))
        loaded = source.read(slice(None), slice(start, end))
        check_shape(param.data[expert], loaded, source.name)
        param.data[expert].copy_(loaded)


def _no_expert(name: str, expert: int, total: int) -> Exception:
    from aserve.errors import CorruptModelFileError

    return CorruptModelFileError(f"{name}: expert {expert} does not exist (config.json says {total} experts)")


class Router(nn.Module):
    """The router's [E, H] weight, whole on every rank (small: E x H)."""

    def __init__(self, num_experts: int, hidden: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(num_experts, hidden, dtype=dtype)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, a dense SwiGLU MLP whose down projection is left
    unreduced: the MoE layer adds its gated partial sum to the experts' before the one
    all-reduce."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=False, tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, tp=tp, dtype=dtype, reduce=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MoEMLP(nn.Module):
    """The MoE layer's MLP; parameter names follow the Qwen checkpoints (``gate``,
    ``experts``, ``shared_expert``, ``shared_expert_gate``), Mixtral's are renamed to
    them at load."""

    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None
    #: Routing reads the experts' token counts back to the host (``bincount().tolist()``),
    #: which a CUDA graph cannot capture (aserve.worker.cuda_graphs).
    graph_unsafe = True

    def __init__(self, hidden: int, moe: MoEConfig, act: str, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_float32 = moe.weights_in_float32
        self.gate = Router(moe.num_experts, hidden, dtype=dtype)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, tp=tp, dtype=dtype)
        self.act = activation(act)
        self.silu = act == "silu"
        self.shared_expert: SharedExpert | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, moe.shared_expert_intermediate_size, act, tp=tp, dtype=dtype)
            self.shared_expert_gate = Router(1, hidden, dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        tokens = order // self.top_k  # each sorted pair's token
        rows = x.index_select(0, tokens)  # [T * k, H], grouped by expert
        experts, local = self.experts, self.experts.local
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            h = experts.gate_up(rows[start : start + n], expert)  # [n, 2 * I_local]
            if self.silu and self.fused_ops is not None and self.fused_ops.supports(h):
                h = self.fused_ops.silu_mul(h)
            else:
                h = self.act(h[:, :local]).mul_(h[:, local:])
            out_rows[start : start + n] = experts.down(h, expert)
            start += n
        pair_weights = weights.reshape(-1)[order].unsqueeze(1)
        weighted = out_rows.mul_(pair_weights) if pair_weights.dtype == out_rows.dtype else out_rows * pair_weights
        out = torch.zeros(x.shape, dtype=weighted.dtype, device=x.device).index_add_(0, tokens, weighted).to(x.dtype)
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)
