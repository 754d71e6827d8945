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

from aserve.errors import CorruptModelFileError, ModelFileNotFoundError


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | dynamic | llama3
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


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
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


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


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # Newer transformers: everything under rope_parameters. Older: rope_theta at the
    # top level and an optional rope_scaling dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "dynamic", "llama3"):
        raise CorruptModelFileError(
            f"rope type {kind!r} is not supported; supported: default, linear, dynamic, llama3"
        )
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
    )


def load_arch_config(model_dir: Path) -> ArchConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for stop tokens).

    Raises ``ModelFileNotFoundError`` or ``CorruptModelFileError`` naming the file.
    """
    cfg = read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    if not archs:
        raise CorruptModelFileError(f"{model_dir / 'config.json'} has no 'architectures' list")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        arch = ArchConfig(
            architecture=str(archs[0]),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=False,
            rope=_rope_config(cfg),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelFileError(f"{model_dir / 'config.json'} lacks or garbles a field: {exc!r}") from exc
    if arch.hidden_act != "silu":
        raise CorruptModelFileError(f"hidden_act {arch.hidden_act!r} is not supported (only silu)")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            arch = _replace(arch, eos_token_ids=_as_id_tuple(gen["eos_token_id"]))
    return arch


def _replace(arch: ArchConfig, **changes: Any) -> ArchConfig:
    import dataclasses

    return dataclasses.replace(arch, **changes)
