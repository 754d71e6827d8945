"""RMSNorm, computed in float32 as Hugging Face does, so bf16 outputs match."""

from __future__ import annotations

import torch
from torch import nn

from aserve.model.layers.weights import new_param


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)
