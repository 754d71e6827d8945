"""Reads a Hugging Face ``config.json`` into the few numbers the model code needs.

Real checkpoints spell the same facts several ways (``rope_theta`` at the top level or
inside ``rope_parameters``; ``rope_scaling`` with ``type`` or ``rope_type``;
``torch_dtype`` or ``dtype``; ``head_dim`` absent, null or different from
``hidden_size / num_attention_heads``). This module resolves them once so the model code
sees one spelling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aserve.errors import CorruptModelFileError, ModelFileNotFoundError, UnsupportedModelFeatureError


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | dynamic | llama3 | longrope
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # longrope (Phi-3): per-frequency divisors below and from original_max_position_embeddings,
    # and the factor cos and sin are multiplied by (None: sqrt(1 + ln(factor) / ln(original)))
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU experts of width ``intermediate_size``,
    ``top_k`` of them per token by a softmax router."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1 (Mixtral: always)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    weights_in_float32: bool = False  # Mixtral keeps the routing weights in float32


@dataclass(frozen=True)
class ArchConfig:
    """The architecture facts of one checkpoint, independent of how they were spelled."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig
    torch_dtype: str | None
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (GeGLU)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    #: Per layer: its sliding window (a query sees itself and the window - 1 keys before
    #: it) or None for a global layer. Empty: every layer global.
    layer_windows: tuple[int | None, ...] = ()
    #: The rotary embedding of the sliding layers, where it differs (Gemma 3's local base).
    local_rope: RopeConfig | None = None
    #: Per layer: whether it rotates q and k (SmolLM3's NoPE layers do not). Empty: all do.
    rope_layers: tuple[bool, ...] = ()
    partial_rotary_factor: float = 1.0  # the leading share of each head that is rotated
    attn_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    final_softcap: float | None = None
    attn_scale: float | None = None  # the attention logits' scale (None: head_dim ** -0.5)
    embedding_multiplier: float | None = None  # Granite; Gemma's sqrt(hidden) is its model's
    residual_multiplier: float = 1.0  # Granite: each branch's output, before the residual add
    logits_scaling: float = 1.0  # Granite: logits are divided by it
    moe: MoEConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFileNotFoundError(f"{path.name} not found in {path.parent}: is this a Hugging Face model directory?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelFileError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptModelFileError(f"{path} must hold a JSON object")
    return data


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "longrope")


def _rope_from(merged: dict[str, Any], cfg: dict[str, Any], where: str = "rope_scaling") -> RopeConfig:
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind not in ROPE_KINDS:
        raise UnsupportedModelFeatureError(
            f"rope type {kind!r} ({where}) is not supported; supported: {', '.join(ROPE_KINDS)}", field=where)
    original = cfg.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings")
    attention_factor = merged.get("attention_factor")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _rope_configs(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the global layers' rope, the sliding layers' where it differs). Newer
    transformers: everything under ``rope_parameters``, per layer type when the types
    differ (Gemma 3). Older: ``rope_theta`` at the top level, an optional
    ``rope_scaling`` dict, and Gemma 3's ``rope_local_base_freq``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), dict):
        full = _rope_from({**scaling, **params["full_attention"]}, cfg, "rope_parameters.full_attention")
        local = params.get("sliding_attention")
        return full, (_rope_from(dict(local), cfg, "rope_parameters.sliding_attention")
                      if isinstance(local, dict) else None)
    full = _rope_from({**scaling, **params}, cfg)
    local_base = cfg.get("rope_local_base_freq")
    return full, (None if local_base is None else RopeConfig(theta=float(local_base)))


#: Activations of the gated MLP: ``act(gate) * up``.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _layer_windows(arch: str, cfg: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, by the rules transformers applies to each config:
    an explicit ``layer_types`` list wins; else Gemma 2 alternates (layer 0 local), Gemma 3
    has ``sliding_window_pattern - 1`` local layers to one global, Qwen2 slides from
    ``max_window_layers`` when ``use_sliding_window``, and the rest (Mistral, Mixtral,
    Phi-3) slide on every layer when ``sliding_window`` is set."""
    if arch == "MistralForCausalLM" and "sliding_window" not in cfg:
        window = 4096  # MistralConfig's default when the key is absent
    else:
        window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if cfg.get("use_sliding_window") is False:
        return ()
    if arch == "Gemma2ForCausalLM":
        return tuple(window if (i + 1) % 2 else None for i in range(layers))
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(window if (i + 1) % pattern else None for i in range(layers))
    if arch == "Qwen2ForCausalLM":
        if not cfg.get("use_sliding_window"):
            return ()
        start = int(cfg.get("max_window_layers", layers))
        return tuple(window if i >= start else None for i in range(layers))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM"):
        if not cfg.get("use_sliding_window"):
            return ()
        if arch == "Qwen2MoeForCausalLM":
            start = int(cfg.get("max_window_layers", layers))
            return tuple(window if (i + 1) % 2 and i < start else None for i in range(layers))
        if arch == "SmolLM3ForCausalLM":
            rope = _rope_layers(arch, cfg, layers)
            return tuple(None if uses_rope else window for uses_rope in rope)
    return (window,) * layers


def _rope_layers(arch: str, cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = cfg.get("no_rope_layers")
    if isinstance(flags, list) and len(flags) == layers:
        return tuple(bool(f) for f in flags)  # 1: rotary applied; 0: NoPE
    interval = int(cfg.get("no_rope_layer_interval", 4))
    return tuple(bool((i + 1) % interval) for i in range(layers))


def _moe_config(arch: str, cfg: dict[str, Any], layers: int) -> MoEConfig | None:
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
        return None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if experts <= 0 or not 0 < top_k <= experts:
        raise CorruptModelFileError(f"config.json: {experts} experts with top {top_k} is not a mixture of experts")
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, top_k, int(cfg["intermediate_size"]), True, (True,) * layers,
                         weights_in_float32=True)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoEConfig(experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)),
                     sparse, shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def load_arch_config(model_dir: Path) -> ArchConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for stop tokens).

    Raises ``ModelFileNotFoundError`` or ``CorruptModelFileError`` naming the file.
    """
    cfg = read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    if not archs:
        raise CorruptModelFileError(f"{model_dir / 'config.json'} has no 'architectures' list")
    name = str(archs[0])
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelFeatureError(
            f"config.json: quantization_config ({method}) is not supported; aserve serves float32, bfloat16 and "
            "float16 weights", field="quantization_config")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        rope, local_rope = _rope_configs(cfg)
        gemma = name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
        attn_scale = None
        if gemma:
            attn_scale = float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5
        elif cfg.get("attention_multiplier") is not None:
            attn_scale = float(cfg["attention_multiplier"])
        softcaps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if name == "Gemma2ForCausalLM" else {}
        arch = ArchConfig(
            architecture=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma or name == "SmolLM3ForCausalLM")),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", name == "Qwen2MoeForCausalLM"))),
            qk_norm=False,
            rope=rope,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            hidden_act=act,
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            layer_windows=_layer_windows(name, cfg, layers),
            local_rope=local_rope,
            rope_layers=_rope_layers(name, cfg, layers),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor")
                                        or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0),
            # Gemma 3 stores attn_logit_softcapping but does not apply it (nor does transformers).
            attn_softcap=None if name == "Gemma3ForCausalLM" else _opt_float(
                cfg.get("attn_logit_softcapping", softcaps.get("attn_logit_softcapping"))),
            final_softcap=_opt_float(cfg.get("final_logit_softcapping", softcaps.get("final_logit_softcapping"))),
            attn_scale=attn_scale,
            embedding_multiplier=_opt_float(cfg.get("embedding_multiplier")),
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
            moe=_moe_config(name, cfg, layers),
            raw=cfg,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelFileError(f"{model_dir / 'config.json'} lacks or garbles a field: {exc!r}") from exc
    if arch.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelFeatureError(
            f"config.json: activation {arch.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}",
            field="hidden_act")
    if arch.rope.kind == "longrope":
        rotary_half = int(head_dim * arch.partial_rotary_factor) // 2
        for which in ("short_factor", "long_factor"):
            if len(getattr(arch.rope, which)) != rotary_half:
                raise CorruptModelFileError(f"config.json: rope {which} needs {rotary_half} values (half the rotary "
                                            f"dimensions), not {len(getattr(arch.rope, which))}")
        if not arch.rope.original_max_position_embeddings:
            raise CorruptModelFileError("config.json: longrope needs original_max_position_embeddings")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            arch = _replace(arch, eos_token_ids=_as_id_tuple(gen["eos_token_id"]))
    return arch


def _replace(arch: ArchConfig, **changes: Any) -> ArchConfig:
    import dataclasses

    return dataclasses.replace(arch, **changes)
