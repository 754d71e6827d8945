"""RMSNorm with the mean square accumulated in float32, as Hugging Face computes it.

On CPU the C kernel of :mod:`aserve.kernels.cpu_fused_ops` does it in one call, with
the residual add before it (per-head norms, [T, H, D], as [T * H, D] rows). Otherwise
two torch forms, picked by batch size. Up to :data:`FUSED_MAX_TOKENS` rows (decode
steps) ``torch.rms_norm``, one fused op, saves the ~5 small ops of the written-out form
(3-5 us a call on this CPU) and gives Hugging Face's float32 values exactly. Above that
the written-out form: the fused op takes 2-3x longer on a prefill-sized batch ([4096, 1024]:
9.5 ms against 4.1 ms in float32, 11.9 against 4.0 in bf16). It rounds the scale to the
activation dtype before it multiplies, which in bf16 differs from Hugging Face's order
by at most one rounding.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import nn

from aserve.kernels.cpu_fused_ops import FusedOps
from aserve.model.layers.weights import TensorSource, check_shape, new_param


#: Batches of at most this many rows use the fused op.
FUSED_MAX_TOKENS = 256


class RMSNorm(nn.Module):
    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None

    def __init__(self, hidden: int, eps: float, *, dtype: torch.dtype, offset: float = 0.0) -> None:
        """``offset``: added to the checkpoint's weight as it loads (Gemma's norms scale by
        ``1 + weight``), so every path, the C kernels included, computes the usual form.
        In float32 that is Hugging Face's value; in bf16 ``1 + weight`` is rounded once."""
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = new_param(hidden, dtype=dtype, loader=self._load)

    def _load(self, param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
        loaded = source.read()
        check_shape(param, loaded, source.name)
        if self.offset:
            loaded = loaded.float() + self.offset
        param.data.copy_(loaded)

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with a residual, ``(norm(x + residual), x + residual)`` (the
        decoder layer's skip connection folded into its next norm)."""
        ops = self.fused_ops
        if ops is not None and ops.supports(x) and (residual is None or ops.supports(residual)):
            out, new_residual = ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if ops is not None and residual is None and x.dim() > 2:
            # Per-head norms (Qwen3's q/k norm on [T, H, D]): the same kernel on [T * H, D]
            # rows, so the one-call decode step (which norms the heads in place) agrees.
            rows = x.reshape(-1, x.shape[-1])
            if ops.supports(rows):
                return ops.rms_norm(rows, self.weight, self.eps)[0].view(x.shape)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # [..., H] -> [..., H]
        if x.shape[0] <= FUSED_MAX_TOKENS:
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        scale = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(self.eps))
        return x * scale.to(x.dtype) * self.weight


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose features are split over TP ranks (OLMo 2's
    q and k norms span every head): each rank holds its slice of the weight, and the mean
    square is summed over ranks. ``replicas``: how many ranks hold each feature (KV heads
    replicated over more ranks than there are heads), so the sum counts each once."""

    def __init__(self, full: int, start: int, end: int, eps: float, *, dtype: torch.dtype, replicas: int = 1) -> None:
        super().__init__()
        self.eps = eps
        self.full = full
        self.slice = (start, end)
        self.replicas = replicas
        self.weight = new_param(end - start, dtype=dtype, loader=self._load)

    def _load(self, param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
        from aserve.model.layers.weights import expect_full_shape

        expect_full_shape(source, (self.full,))
        loaded = source.read(slice(*self.slice))
        check_shape(param, loaded, source.name)
        param.data.copy_(loaded)

    def sum_squares(self, x: torch.Tensor) -> torch.Tensor:
        """[T] float32 sums of squares of this rank's features (divided by the replicas)."""
        sq = x.float().square().sum(dim=-1)
        return sq / self.replicas if self.replicas > 1 else sq

    def apply(self, x: torch.Tensor, total_squares: torch.Tensor) -> torch.Tensor:
        """``x`` normalised by the mean square over all ranks' features, then scaled (in
        float32, as OLMo 2's norm multiplies before it casts)."""
        scale = torch.rsqrt(total_squares / self.full + self.eps).unsqueeze(-1)
        return (x.float() * scale * self.weight.float()).to(x.dtype)
