"""Llama (and Mistral, which has the same layout) built from tensor-parallel layers, and
the options every other decoder-only architecture is made of.

One decoder layer::

    x ─► input_layernorm ─► qkv_proj ─► [q_norm, k_norm] ─► rotary ─► attention ─► o_proj ─┐
    │                                                                                       │
    └────────────────────────────────── + ◄─────────────────────────────────────────────────┘
    x ─► post_attention_layernorm ─► gate_up_proj ─► silu(gate) * up ─► down_proj ─► + x

Each "+ x" is done by the norm that follows it (one fused call on CPU), so a layer
returns (its MLP output, the residual) and the next layer's first norm adds them.

Every other architecture is this model with options (:class:`DecoderOptions`, set by
its class in its own file, and the per-layer facts of :class:`ArchConfig`): the norms'
placement (Gemma's before and after each block, OLMo 2's after only) and their
``1 + weight`` form; q/k norms per head or over the whole projection; biases; a GeGLU
MLP; a mixture of experts in place of the MLP; sliding-window and soft-capped attention;
rotary per layer (Gemma 3's local base, SmolLM3's layers without it, partial rotary);
embedding, residual and logit multipliers. :meth:`LlamaModel.fast_path_blockers` says
which options the one-call decode stack cannot compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
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
from aserve.model.layers.moe import MoEMLP, activation, expert_param
from aserve.model.layers.norm import RMSNorm, ShardedRMSNorm
from aserve.model.layers.rotary import RotaryEmbedding
from aserve.model.pipeline import Stage


@dataclass(frozen=True)
class DecoderOptions:
    """What an architecture changes in the Llama layer (its class sets them)."""

    #: ``pre``: a norm before attention and before the MLP (Llama); ``sandwich``: before and
    #: after each (Gemma 2 and 3); ``post``: after each only (OLMo 2).
    norm_layout: str = "pre"
    norm_offset: float = 0.0  # Gemma: norms scale by 1 + weight
    qk_norm: str | None = None  # "head": per head (Qwen3, Gemma 3); "full": over the projection (OLMo 2)
    qkv_bias: bool | None = None  # None: the config's attention_bias
    o_bias: bool | None = None
    embed_scale_sqrt_hidden: bool = False  # Gemma: embeddings times sqrt(hidden), in the model dtype


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: DecoderOptions, rotary: RotaryEmbedding | None, layer: int, *,
                 tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        qkv_bias = cfg.attention_bias if opts.qkv_bias is None else opts.qkv_bias
        o_bias = cfg.attention_bias if opts.o_bias is None else opts.o_bias
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=qkv_bias, tp=tp, dtype=dtype
        )
        self.tp = tp
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias, tp=tp, dtype=dtype)
        self.qk_norm = opts.qk_norm
        if opts.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, offset=opts.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, offset=opts.norm_offset)
        elif opts.qk_norm == "full":
            q_start = tp.rank * self.q_size
            kv_rank = tp.rank // self.qkv_proj.kv_replicas
            self.q_norm = ShardedRMSNorm(cfg.num_attention_heads * cfg.head_dim, q_start, q_start + self.q_size,
                                         cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = ShardedRMSNorm(cfg.num_key_value_heads * cfg.head_dim, kv_rank * self.kv_size,
                                         (kv_rank + 1) * self.kv_size, cfg.rms_norm_eps, dtype=dtype,
                                         replicas=self.qkv_proj.kv_replicas)
        self.rotary = rotary
        self.window = cfg.window_of(layer)
        self.softcap = cfg.attn_softcap
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, scale,
                              window=self.window, softcap=self.softcap)

    @property
    def use_qk_norm(self) -> bool:
        """Per-head q/k norms (what the one-call decode stack computes)."""
        return self.qk_norm == "head"

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, kv_cache: LayerKV,
                meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for every token, or only for ``rows`` (indices into the
        step's tokens): every token's keys and values are still projected and cached, and
        every token's attention computed, but the output projection runs on those rows
        alone."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm == "full":
            qkv = self._norm_projections(qkv)
        qkv = qkv.view(n, -1, self.head_dim)  # [T, Hq + 2 Hk, D]
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.use_qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        if self.rotary is not None:
            assert rope is not None
            qk = self.rotary(rope, qk)  # [T, Hq + Hk, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn(q, k, v, kv_cache, meta).reshape(n, self.q_size)  # k and v are strided views
        return self.o_proj(o if rows is None else o[rows])

    def _norm_projections(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMo 2: RMSNorm over the whole q and the whole k projection; under TP the
        sums of squares of both are all-reduced together (one small all-reduce)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        squares = torch.stack((self.q_norm.sum_squares(q), self.k_norm.sum_squares(k)), dim=-1)  # [T, 2]
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares.contiguous())
        return torch.cat((self.q_norm.apply(q, squares[:, 0]), self.k_norm.apply(k, squares[:, 1]), v), dim=-1)


class LlamaMLP(nn.Module):
    #: The C kernels (:mod:`aserve.kernels.cpu_fused_ops`), attached after loading on CPU.
    fused_ops: FusedOps | None = None

    def __init__(self, cfg: ArchConfig, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=False, tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, tp=tp, dtype=dtype)
        self.hidden_act = cfg.hidden_act
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gp = self.gate_up_proj
        if (self.hidden_act == "silu" and self.fused_ops is not None and gp.amx is not None and x.dim() == 2
                and gp.amx.fuses_silu(gp.out_rows) and gp.amx.fused_silu_pays(x.shape[0], x.shape[1])):
            # A long prefill on AMX: the product and the activation in one pass, the
            # [T, 2 inter] product never written out; the same bits as the two calls below.
            return self.down_proj(gp.amx.linear_silu(x, gp.amx_weight, gp.out_rows // 2))
        gate_up = gp(x)
        if self.hidden_act == "silu" and self.fused_ops is not None and self.fused_ops.supports(gate_up):
            return self.down_proj(self.fused_ops.silu_mul(gate_up))
        if (self.hidden_act == "gelu_pytorch_tanh" and hasattr(self.fused_ops, "gelu_tanh_mul")
                and self.fused_ops.supports(gate_up)):  # the Triton kernels have GeGLU; the C ones do not
            return self.down_proj(self.fused_ops.gelu_tanh_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        # In place on the activation's fresh output: one large temporary fewer.
        return self.down_proj(self.act(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: DecoderOptions, rotary: RotaryEmbedding | None, layer: int, *,
                 tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, opts.norm_offset
        self.layout = opts.norm_layout
        if self.layout != "post":
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, offset=offset)
        self.self_attn = LlamaAttention(cfg, opts, rotary, layer, tp=tp, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, offset=offset)
        if self.layout != "pre":
            if self.layout == "sandwich":
                self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, offset=offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, offset=offset)
        if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            self.mlp: nn.Module = MoEMLP(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp=tp, dtype=dtype)
        else:
            self.mlp = LlamaMLP(cfg, tp=tp, dtype=dtype)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: LayerKV, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``: the skip connection is added by the next norm
        (``x + residual`` is the hidden state Hugging Face's layer returns). With ``rows``
        (the last layer, when only some tokens' hidden states are read) both come for
        those rows alone, in their order; every token's keys and values are cached."""
        if self.layout == "post":
            return self._forward_post_norms(rope, x, residual, kv_cache, meta, rows)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows]
        if self.layout == "sandwich":
            h = self.post_attention_layernorm(h)
            h, residual = self.pre_feedforward_layernorm(self._scaled(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(self._scaled(h), residual)
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A block's output before the residual add (Granite's residual multiplier)."""
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def _forward_post_norms(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor,
                            residual: torch.Tensor | None, kv_cache: LayerKV, meta: AttentionMetadata,
                            rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2: no norm before a block, one after each: ``x + norm(block(x))``."""
        hidden = x if residual is None else x + residual
        h = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta, rows))
        hidden = (hidden if rows is None else hidden[rows]) + h
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds: no parameters, never called."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a layer of another pipeline stage was called")


def _stack_weight(lin: ColumnParallelLinear | RowParallelLinear,
                  kernel: LlamaDecodeKernel) -> tuple[torch.Tensor, int, int] | None:
    """``(weight, output width, output features)`` of ``lin`` as ``kernel`` takes it, or
    None when ``lin`` is not in that form: bf16, the tiled weight of the AMX or AVX512-BF16 kernel (its width padded
    to 32); float32, the AVX2 kernel's packed weight."""
    if kernel.dtype == torch.bfloat16:
        return None if lin.amx is None else (lin.amx_weight, padded_width(lin.out_rows), lin.out_rows)
    return None if lin.f32 is None else (lin.f32_weight, lin.out_rows, lin.out_rows)


class LlamaModel(nn.Module):
    #: Every layer of a decode step in one C call (:meth:`attach_decode_stack`), when it applies.
    decode_stack: DecodeStack | None = None

    def __init__(self, cfg: ArchConfig, opts: DecoderOptions, max_positions: int, *, tp: TPGroup,
                 dtype: torch.dtype, stage: Stage | None = None) -> None:
        """``stage``: the pipeline stage this rank computes (default: the whole model);
        layers of other stages are placeholders, the embedding is built on the first
        stage (and on the last when the head is tied to it), the final norm on the last."""
        super().__init__()
        self.stage = stage = stage or Stage.whole(cfg.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
                             if stage.is_first or (stage.is_last and cfg.tie_word_embeddings) else None)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_positions, dtype=dtype,
                                 rotary_dim=rotary_dim)
        self.rotary = rotary
        self.local_rotary = None if cfg.local_rope is None else RotaryEmbedding(
            cfg.local_rope, cfg.head_dim, cfg.max_position_embeddings, max_positions, dtype=dtype, rotary_dim=rotary_dim)
        # Per layer: 0 the global rotary, 1 the sliding layers' own, None no rotary.
        self.rope_of_layer: list[int | None] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.rope_layers and not cfg.rope_layers[i]:
                self.rope_of_layer.append(None)
            else:
                self.rope_of_layer.append(1 if self.local_rotary is not None and cfg.window_of(i) is not None else 0)
        rotaries = (rotary, self.local_rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, opts, None if r is None else rotaries[r], i, tp=tp, dtype=dtype)
            if stage.holds_layer(i) else MissingLayer()
            for i, r in enumerate(self.rope_of_layer))
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=opts.norm_offset)
                     if stage.is_last else None)
        self.embed_scale: float | None = None
        if opts.embed_scale_sqrt_hidden:
            # Rounded to the model dtype as Hugging Face does (sqrt(3072) is 55.5 in bf16).
            self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5).to(dtype))
        elif cfg.embedding_multiplier is not None:
            self.embed_scale = cfg.embedding_multiplier

    def fast_path_blockers(self) -> list[str]:
        """Why the one-call decode stack cannot run these layers (empty: it can): each
        option of :class:`DecoderOptions` and of the config it does not compute."""
        layers = list(self.layers)
        reasons = []
        if self.stage.size > 1:
            return ["pipeline stages"]
        if any(layer.layout != "pre" for layer in layers):
            reasons.append(f"{layers[0].layout} norms")
        if any(layer.self_attn.window is not None for layer in layers):
            reasons.append("sliding-window attention")
        if any(layer.self_attn.softcap is not None for layer in layers):
            reasons.append("attention soft-capping")
        if any(layer.self_attn.qk_norm == "full" for layer in layers):
            reasons.append("q/k norms over the whole projection")
        if any(layer.self_attn.rotary is not self.rotary for layer in layers):
            reasons.append("rotary that differs between layers")
        if self.rotary.rotary_dim != layers[0].self_attn.head_dim:
            reasons.append("partial rotary")
        if any(not isinstance(layer.mlp, LlamaMLP) for layer in layers):
            reasons.append("mixture-of-experts layers")
        elif any(layer.mlp.hidden_act != "silu" for layer in layers):
            reasons.append(f"{layers[0].mlp.hidden_act} activation")
        if any(layer.residual_multiplier != 1.0 for layer in layers):
            reasons.append("residual multipliers")
        return reasons

    def attach_decode_stack(self, kernel: LlamaDecodeKernel) -> bool:
        """Run decode steps through ``kernel`` (one C call for every layer) if this
        model's layers are exactly what it computes: Llama layers (no biases but on
        q/k/v, as Qwen2 has; Qwen3's per-head q/k norms), every linear in the kernel's
        form (bf16: on AMX or AVX512-BF16; float32: on the float32 kernel), the C norm, rotary
        and SiLU kernels attached; with tensor parallelism in bf16, a hidden size that is
        a multiple of 32 (the summed outputs are then unpadded). Returns whether it was
        attached (the stack checks the weights' dtype)."""
        layers = list(self.layers)
        if not layers or self.fast_path_blockers() or type(self.norm) is not RMSNorm or self.rotary.fused_ops is None:
            return False
        tensors = []
        first_forms: list[tuple[torch.Tensor, int, int]] = []  # the first layer's: every layer has its widths
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            forms = [_stack_weight(lin, kernel) for lin in linears]
            if (type(layer).forward is not LlamaDecoderLayer.forward or type(attn).forward is not LlamaAttention.forward
                    or type(mlp).forward is not LlamaMLP.forward
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                output_rows: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states ([T, hidden], after the norm) on the last stage; on
        the others ``(x, residual)`` for the next stage. A stage after the first starts
        from the previous stage's ``intermediate`` instead of the embedding.
        ``kv_caches`` are this stage's layers' own, in order.

        ``output_rows`` (the last stage only): the indices of the tokens whose hidden
        states the caller reads (those that sample), in the order it reads them; the
        result is then [len(output_rows), hidden]. The last layer runs its output
        projection and MLP on those rows alone, after caching every token's keys and
        values: a prompt's other positions only feed the cache, and from the last layer
        nothing reads their outputs (docs/engine.md, "The last layer")."""
        assert output_rows is None or self.stage.is_last
        stage = self.stage
        rope = self.rotary.gather(positions)  # once for all layers
        if stage.is_first:
            x = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embed_scale is not None:
                x = x * self.embed_scale
            residual = None
            if self.decode_stack is not None and not meta.prefills and meta.decode_kernel is not None:
                # Decode rows only: every layer in one C call, bit-identical to the loop below.
                # The runner gives the C attention kernel its table and lengths.
                assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
                x, residual = self.decode_stack.run(x, rope[0], rope[1], [kv.paged for kv in kv_caches],
                                                    meta.decode_block_table, meta.decode_seq_lens,
                                                    meta.decode_prefix_blocks, [kv.prefix_slot for kv in kv_caches])
                if output_rows is not None:
                    x, residual = x[output_rows], residual[output_rows]
                return self.norm(x, residual)[0]
        else:
            assert intermediate is not None
            x, residual = intermediate
        ropes = (rope, None if self.local_rotary is None else self.local_rotary.gather(positions))
        for i, kv_cache in zip(range(stage.start, stage.end), kv_caches):
            r = self.rope_of_layer[i]
            rows = output_rows if i == stage.end - 1 else None
            x, residual = self.layers[i](None if r is None else ropes[r], x, residual, kv_cache, meta, rows)
            if meta.layer_done is not None:
                meta.layer_done()
        if not stage.is_last:
            assert residual is not None  # a stage holds at least one layer
            return x, residual
        if residual is None:  # no layers
            return self.norm(x if output_rows is None else x[output_rows])
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Hidden states for a flattened batch of tokens, and logits for the chosen rows."""

    options = DecoderOptions()

    # Checkpoint name fragment -> (our merged parameter fragment, part id).
    stacked_params: tuple[tuple[str, str, Any], ...] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )
    #: Checkpoint name fragments renamed before anything else (Mixtral's MoE block).
    renamed_params: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: ArchConfig, *, max_positions: int, tp: TPGroup, dtype: torch.dtype,
                 stage: Stage | None = None) -> None:
        """``stage``: the pipeline stage built (default: the whole model; see LlamaModel)."""
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, self.options, max_positions, tp=tp, dtype=dtype, stage=stage)
        self.stage = self.model.stage
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
                        if self.stage.is_last else None)
        if cfg.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def checkpoint_param(cls, name: str) -> tuple[str, Any]:
        """A checkpoint tensor's name -> (the parameter it fills, its shard id)."""
        for fragment, renamed in cls.renamed_params:
            name = name.replace(fragment, renamed)
        expert = expert_param(name)
        if expert is not None:
            return expert
        for fragment, merged, part in cls.stacked_params:
            if fragment in name:
                return name.replace(fragment, merged), part
        return name, None

    @property
    def num_local_kv_heads(self) -> int:
        return self.model.layers[self.stage.start].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                output_rows: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`LlamaModel.forward`."""
        return self.model(input_ids, positions, kv_caches, meta, intermediate, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling  # Granite
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fast_path_blockers(self) -> list[str]:
        """See :meth:`LlamaModel.fast_path_blockers`."""
        return self.model.fast_path_blockers()

    def attach_decode_stack(self, kernel: LlamaDecodeKernel) -> bool:
        """See :meth:`LlamaModel.attach_decode_stack`."""
        return self.model.attach_decode_stack(kernel)


class MistralForCausalLM(LlamaForCausalLM):
    pass
