"""What the architectures beyond Llama add, checked where the end-to-end parity tests
(tests/test_hf_parity.py) cannot see it: MoE routing against transformers' router, the
per-layer facts read from config.json, the refusals at config time, and the one-time
log line of a model whose decode steps cannot run in one C call."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from aserve import LLM
from aserve.distributed.tp_group import TPGroup
from aserve.engine.args import EngineArgs
from aserve.errors import ConfigError, UnsupportedModelFeatureError
from aserve.model.hf_config import load_arch_config
from aserve.model.layers.moe import MoEMLP
from aserve.model.loader import load_model
from tests.hf_reference import load_hf

MOE = ["qwen3_moe", "mixtral", "qwen2_moe"]


@pytest.mark.parametrize("arch", MOE)
@torch.inference_mode()
def test_moe_layer_routes_and_mixes_as_transformers(arch, model_dirs):
    """Each sparse layer's output on random hidden states equals transformers' block, on
    inputs whose k-th and (k+1)-th router probabilities are apart (no ties to break)."""
    path = model_dirs[arch]
    cfg = load_arch_config(path)
    ours = load_model(path, cfg, dtype=torch.float32, max_positions=64, tp=TPGroup.single())
    hf = load_hf(path)
    g = torch.Generator().manual_seed(3)
    checked = 0
    for i, layer in enumerate(ours.model.layers):
        if not isinstance(layer.mlp, MoEMLP):
            continue
        x = torch.randn(64, cfg.hidden_size, generator=g)
        probs = torch.softmax(x @ layer.mlp.gate.weight.t(), dim=-1).sort(dim=-1, descending=True).values
        k = cfg.moe.top_k
        clear = (probs[:, k - 1] - probs[:, k]) > 1e-3
        x = x[clear]
        assert x.shape[0] >= 32
        hf_mlp = hf.model.layers[i].mlp
        expected = hf_mlp(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        torch.testing.assert_close(layer.mlp(x), expected, rtol=1e-5, atol=1e-6)
        weights, experts = layer.mlp.route(x)
        assert experts.shape == (x.shape[0], k)
        if cfg.moe.norm_topk_prob:
            torch.testing.assert_close(weights.float().sum(-1), torch.ones(x.shape[0]))
        checked += 1
    assert checked == sum(cfg.moe.sparse_layers) > 0


def test_config_facts_per_layer(model_dirs):
    gemma2 = load_arch_config(model_dirs["gemma2"])
    assert gemma2.layer_windows == (8, None, 8)  # layer 0 local, alternating
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (1.5, 2.0)
    assert gemma2.attn_scale == pytest.approx(24**-0.5)
    assert gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = load_arch_config(model_dirs["gemma3"])
    assert gemma3.layer_windows == (8, 8, None, 8)
    assert (gemma3.rope.theta, gemma3.rope.kind, gemma3.local_rope.theta) == (1e6, "linear", 1e4)
    smol = load_arch_config(model_dirs["smollm3"])
    assert smol.rope_layers == (True, False, True, False)
    assert smol.layer_windows == (None, 8, None, 8)  # only the NoPE layers slide
    qwen3_moe = load_arch_config(model_dirs["qwen3_moe"])
    assert qwen3_moe.moe.sparse_layers == (True, False, True)
    phi3 = load_arch_config(model_dirs["phi3"])
    assert phi3.rope.kind == "longrope" and phi3.partial_rotary_factor == 0.5


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, field", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "rope_scaling"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_unsupported_config_refused_before_any_process_starts(changes, field, llama_dir, tmp_path):
    model = _edited(llama_dir, tmp_path / "m", **changes)
    from aserve.engine.fit import fit_config

    with pytest.raises(UnsupportedModelFeatureError) as info:
        fit_config(EngineArgs(model=str(model)).create_engine_config())
    assert info.value.field == field


def test_tp_that_does_not_divide_experts_refused_as_config_error(model_dirs, tmp_path):
    model = _edited(model_dirs["qwen3_moe"], tmp_path / "m", moe_intermediate_size=33)
    from aserve.engine.fit import fit_config

    with pytest.raises(ConfigError, match="expert") as info:
        fit_config(EngineArgs(model=str(model), tensor_parallel_size=2).create_engine_config())
    assert info.value.param == "tensor_parallel_size"


def test_fallback_from_the_one_call_decode_step_is_logged_once_with_its_reasons(model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="aserve.worker"):
        llm = LLM(str(model_dirs["gemma2"]), kv_cache_memory=1 << 24)
    lines = [r.getMessage() for r in caplog.records if "layer by layer" in r.getMessage()]
    assert len(lines) == 1
    assert "sliding-window attention" in lines[0] and "attention soft-capping" in lines[0]
    assert "sandwich norms" in lines[0] and "Gemma2ForCausalLM" in lines[0]
    assert llm.engine.executor.worker.runner.model.model.decode_stack is None
