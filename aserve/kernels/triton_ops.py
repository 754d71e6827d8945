"""The element-wise kernels in Triton, with the interface of the C kernels'
:class:`aserve.kernels.cpu_fused_ops.FusedOps`, so the layers' ``fused_ops`` slot takes
either: RMSNorm with the residual add before it, SiLU(gate) * up and GeGLU (tanh GELU),
and rotary in place. Their plain-torch twins are the layers' own torch forms.

Roundings as Hugging Face's, in float32 inside: ``residual = x + residual`` rounded to the
dtype, then ``weight * dtype(residual * rsqrt(mean(residual^2) + eps))``; ``dtype(act(g))
* up``. On CPU tensors they run in Triton's interpreter (the tests); on a GPU, compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_ro, stride_o, n, eps,
                HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)  # the residual, rounded to the dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_kernel(gu_ptr, out_ptr, stride_in, stride_out, inter, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # gelu_pytorch_tanh
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, half, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + cols, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_c + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + cols, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half + cols, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


class TritonOps:
    """The kernels, for the layers' ``fused_ops`` slot. ``interpret``: CPU tensors are
    accepted (Triton's interpreter runs them: ``TRITON_INTERPRET=1``); otherwise only
    CUDA tensors."""

    def __init__(self, *, interpret: bool = False) -> None:
        self.interpret = interpret

    def supports(self, x: torch.Tensor) -> bool:
        """Whether ``x`` ([rows, n], last dim contiguous) can be passed."""
        on = x.device.type == "cuda" or (self.interpret and x.device.type == "cpu")
        return on and x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(norm(x + residual), x + residual)``, or ``(norm(x), None)``."""
        rows, hidden = x.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out = None if residual is None else torch.empty_like(out)
        if rows:
            r = residual if residual is not None else x
            ro = res_out if res_out is not None else out
            _rms_kernel[(rows,)](x, r, ro, weight, out, x.stride(0), r.stride(0), ro.stride(0), out.stride(0), hidden,
                                 eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(hidden))
        return out, res_out

    def _gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block = min(1024, triton.next_power_of_2(inter))
            _gated_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                             GELU=gelu, BLOCK=block)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` = [rows, 2 * inter] (gate first)."""
        return self._gated(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_pytorch_tanh(gate) * up`` (GeGLU: Gemma's MLP)."""
        return self._gated(gate_up, gelu=True)

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] in place by ``cos`` / ``sin`` ([T, D/2]; a [T, 1, D/2]
        view too), as Hugging Face's ``x * cos + rotate_half(x) * sin``; returns ``x``."""
        tokens, heads, dim = x.shape
        cos, sin = cos.reshape(tokens, dim // 2), sin.reshape(tokens, dim // 2)
        assert x.stride(2) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
        if tokens:
            _rotary_kernel[(tokens, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), dim // 2,
                                            BLOCK=triton.next_power_of_2(dim // 2))
        return x
