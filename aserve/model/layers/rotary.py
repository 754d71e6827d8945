"""Rotary position embedding (the "rotate half" / NeoX layout Llama checkpoints use),
with the scaling variants ``linear``, ``dynamic`` (NTK), ``llama3`` and ``longrope``
(Phi-3), over the whole head or, with a ``partial_rotary_factor``, its leading share.

``longrope`` divides each frequency by a short factor at positions below
``original_max_position_embeddings`` and by a long factor from there on, and scales cos
and sin by its attention factor. Hugging Face instead picks one set for a whole forward
pass by the sequence's length (and recomputes the cache when a sequence crosses the
line); the two agree on every sequence shorter than the original length
(``docs/models.md``).

cos/sin are precomputed in float32 for every position up to ``max_positions`` and
indexed by each token's position, so a batch mixing prefill and decode tokens of many
requests rotates in one call.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aserve.kernels.cpu_fused_ops import FusedOps
from aserve.model.hf_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_positions: int,
                        factors: tuple[float, ...] = ()) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies after scaling (``head_dim``: the rotated
    dimensions); ``factors``: longrope's per-frequency divisors."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if factors:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    base = rope.theta
    if rope.kind == "dynamic" and max_positions > max_position_embeddings:
        # NTK-aware scaling fixed at the longest sequence this engine serves. Hugging
        # Face recomputes it per sequence length, which equals this for the longest
        # sequences and equals plain RoPE up to max_position_embeddings.
        ratio = rope.factor * max_positions / max_position_embeddings - (rope.factor - 1)
        base = base * ratio ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_positions: int, *,
                 dtype: torch.dtype, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim  # the leading dimensions of each head that rotate
        dim = self.rotary_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        if rope.kind == "longrope":
            original = rope.original_max_position_embeddings or max_position_embeddings
            short = torch.outer(positions, inverse_frequencies(rope, dim, max_position_embeddings, max_positions,
                                                               rope.short_factor))
            long = torch.outer(positions, inverse_frequencies(rope, dim, max_position_embeddings, max_positions,
                                                              rope.long_factor))
            freqs = torch.where((positions < original).unsqueeze(1), short, long)
            scale = rope.attention_factor
            if scale is None:
                factor = rope.factor if rope.factor != 1.0 else max_position_embeddings / original
                scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        else:
            freqs = torch.outer(positions, inverse_frequencies(rope, dim, max_position_embeddings, max_positions))
            scale = 1.0
        # [max_positions, rotary_dim / 2] each, in the model dtype as HF applies them. The
        # two halves of the rotated part share them: with x = (x1, x2),
        #   rotated = (x1 cos - x2 sin, x2 cos + x1 sin).
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([T, 1, head_dim / 2]) of a step's positions. The model gathers
        them once per step and every layer's :meth:`forward` reuses them."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] (queries and keys together: one call for both).

        With the C kernels attached: in place, in one call, rounded as Hugging Face's
        ``x * cos + rotate_half(x) * sin``. Otherwise written into the halves of a new
        tensor (``mul`` then ``addcmul_``), without the concatenated copy of ``x`` that
        formula needs (4x faster on a bf16 prefill); ``addcmul_`` rounds its product and
        sum once, so a bf16 result may differ from Hugging Face's by one rounding.
        """
        cos, sin = cos_sin
        if self.rotary_dim != x.shape[-1]:
            # Partial rotary (Phi-3's 0.75 of each head): the leading part rotates, in place.
            x[..., : self.rotary_dim] = self._rotate(x[..., : self.rotary_dim], cos, sin)
            return x
        if (self.fused_ops is not None and x.stride(-1) == 1 and x.dtype == cos.dtype
                and x.dtype in (torch.float32, torch.bfloat16)):
            return self.fused_ops.rotary_(x, cos, sin)  # in place: x is the projection's fresh output
        return self._rotate(x, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty_like(x)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
        return out
