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

from typing import overload

import torch
from torch import nn

from aserve.kernels.cpu_fused_ops import FusedOps
from aserve.model.layers.weights import new_param


#: Batches of at most this many rows use the fused op.
FUSED_MAX_TOKENS = 256


class RMSNorm(nn.Module):
    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None

    def __init__(self, hidden: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden, dtype=dtype)

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
