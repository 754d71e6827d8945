"""Llama (and Mistral, which has the same layout) built from tensor-parallel layers.

One decoder layer::

    x ─► input_layernorm ─► qkv_proj ─► [q_norm, k_norm] ─► rotary ─► attention ─► o_proj ─┐
    │                                                                                       │
    └────────────────────────────────── + ◄─────────────────────────────────────────────────┘
    x ─► post_attention_layernorm ─► gate_up_proj ─► silu(gate) * up ─► down_proj ─► + x

Each "+ x" is done by the norm that follows it (one fused call on CPU), so a layer
returns (its MLP output, the residual) and the next layer's first norm adds them.

Subclasses change only what differs: Qwen2 has biases on q/k/v, Qwen3 RMS-normalises
q and k per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.tp_group import TPGroup
from aserve.kernels.amx_linear import padded_width
from aserve.kernels.attention import AttentionMetadata, LayerKV
from aserve.kernels.cpu_fused_ops import FusedOps
from aserve.kernels.llama_decode import DecodeStack, LayerTensors, LlamaDecodeKernel, StackDims
from aserve.model.hf_config import ArchConfig
from aserve.model.layers.attention import Attention
from aserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aserve.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aserve.model.layers.norm import RMSNorm
from aserve.model.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    qkv_bias_override: bool | None = None  # Qwen2: always True
    o_bias_override: bool | None = None  # Qwen2: always False
    use_qk_norm = False

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        qkv_bias = cfg.attention_bias if self.qkv_bias_override is None else self.qkv_bias_override
        o_bias = cfg.attention_bias if self.o_bias_override is None else self.o_bias_override
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=qkv_bias, tp=tp, dtype=dtype
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias, tp=tp, dtype=dtype)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)  # [T, Hq + 2 Hk, D]
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.use_qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = self.rotary(rope, qk)  # [T, Hq + Hk, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn(q, k, v, kv_cache, meta)  # [T, Hq, D]; k and v are strided views
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None

    def __init__(self, cfg: ArchConfig, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=False, tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, tp=tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_ops is not None and self.fused_ops.supports(gate_up):
            return self.down_proj(self.fused_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        # In place on SiLU's fresh output: one large temporary fewer.
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = self.attention_class(cfg, rotary, tp=tp, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(cfg, tp=tp, dtype=dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: LayerKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``: the skip connection is added by the next norm
        (``x + residual`` is the hidden state Hugging Face's layer returns)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def _stack_weight(lin: ColumnParallelLinear | RowParallelLinear,
                  kernel: LlamaDecodeKernel) -> tuple[torch.Tensor, int, int] | None:
    """``(weight, output width, output features)`` of ``lin`` as ``kernel`` takes it, or
    None when ``lin`` is not in that form: bf16, the AMX-packed weight (its width padded
    to 32); float32, the AVX2 kernel's packed weight."""
    if kernel.dtype == torch.bfloat16:
        return None if lin.amx is None else (lin.amx_weight, padded_width(lin.out_rows), lin.out_rows)
    return None if lin.f32 is None else (lin.f32_weight, lin.out_rows, lin.out_rows)


class LlamaModel(nn.Module):
    #: Every layer of a decode step in one C call (:meth:`attach_decode_stack`), when it applies.
    decode_stack: DecodeStack | None = None

    def __init__(self, cfg: ArchConfig, layer_class: type[LlamaDecoderLayer], max_positions: int, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_positions, dtype=dtype)
        self.rotary = rotary
        self.layers = nn.ModuleList(layer_class(cfg, rotary, tp=tp, dtype=dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def attach_decode_stack(self, kernel: LlamaDecodeKernel) -> bool:
        """Run decode steps through ``kernel`` (one C call for every layer) if this
        model's layers are exactly what it computes: Llama layers (no biases but on
        q/k/v, as Qwen2 has; Qwen3's per-head q/k norms), every linear in the kernel's
        form (bf16: on AMX; float32: on the AVX2 kernel), the C norm, rotary
        and SiLU kernels attached; with tensor parallelism on AMX, a hidden size that is
        a multiple of 32 (the summed outputs are then unpadded). Returns whether it was
        attached (the stack checks the weights' dtype)."""
        layers = list(self.layers)
        if not layers or type(self.norm) is not RMSNorm or self.rotary.fused_ops is None:
            return False
        tensors = []
        first_forms: list[tuple[torch.Tensor, int, int]] = []  # the first layer's: every layer has its widths
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            forms = [_stack_weight(lin, kernel) for lin in linears]
            if (type(layer).forward is not LlamaDecoderLayer.forward or type(attn).forward is not LlamaAttention.forward
                    or type(mlp).forward is not LlamaMLP.forward or attn.rotary is not self.rotary
                    or any(form is None for form in forms) or any(lin.tp is not attn.o_proj.tp for lin in linears)
                    or any(lin.bias is not None for lin in linears[1:])
                    or mlp.fused_ops is None
                    or any(n.fused_ops is None for n in (layer.input_layernorm, layer.post_attention_layernorm))
                    or (attn.use_qk_norm and (attn.q_norm.fused_ops is None or attn.k_norm.fused_ops is None))):
                return False
            first_forms = first_forms or forms  # type: ignore[assignment]
            tensors.append(LayerTensors(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                                        *(form[0] for form in forms),  # type: ignore[index]
                                        None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data,
                                        attn.q_norm.weight.data if attn.use_qk_norm else None,
                                        attn.k_norm.weight.data if attn.use_qk_norm else None))
        first = layers[0]
        attn = first.self_attn
        norms = {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        qk_norms = {n.eps for layer in layers if layer.self_attn.use_qk_norm
                    for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)}
        if len(norms) != 1 or len(qk_norms) > 1:
            return False
        tp = attn.o_proj.tp
        hidden = first.input_layernorm.weight.shape[0]
        if tp.size > 1 and kernel.dtype == torch.bfloat16 and hidden % 32:
            return False
        (qkv_width, _), (o_width, _), (gate_up_width, gate_up_out), (down_width, _) = (form[1:] for form in first_forms)
        self.decode_stack = kernel.stack(tensors, StackDims(
            hidden=hidden, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=gate_up_out // 2,
            qkv_width=qkv_width, o_width=o_width, gate_up_width=gate_up_width, down_width=down_width,
            eps=norms.pop(), scale=attn.attn.scale, qk_eps=qk_norms.pop() if qk_norms else 0.0,
        ), all_reduce=tp.all_reduce if tp.size > 1 else None)
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary.gather(positions)  # once for all layers
        if self.decode_stack is not None and not meta.prefills and meta.decode_kernel is not None:
            # Decode rows only: every layer in one C call, bit-identical to the loop below.
            # The runner gives the C attention kernel its table and lengths.
            assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
            x, residual = self.decode_stack.run(x, rope[0], rope[1], [kv.paged for kv in kv_caches],
                                                meta.decode_block_table, meta.decode_seq_lens)
            return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Hidden states for a flattened batch of tokens, and logits for the chosen rows."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    # Checkpoint name fragment -> (our merged parameter fragment, part id).
    stacked_params = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, cfg: ArchConfig, *, max_positions: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, self.layer_class, max_positions, tp=tp, dtype=dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attach_decode_stack(self, kernel: LlamaDecodeKernel) -> bool:
        """See :meth:`LlamaModel.attach_decode_stack`."""
        return self.model.attach_decode_stack(kernel)


class MistralForCausalLM(LlamaForCausalLM):
    pass
