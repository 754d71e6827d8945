"""Bad input raises a typed exception that says what to fix; the LLM stays usable."""

from __future__ import annotations

import json
import shutil

import pytest

from aserve import LLM, SamplingParams
from aserve.errors import (
    ConfigError,
    CorruptModelFileError,
    EmptyPromptError,
    InvalidInputError,
    InvalidSamplingParamsError,
    ModelFileNotFoundError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory=1 << 24, max_model_len=64)


def still_serves(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_prompt_too_long(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        llm.generate([list(range(10, 80))], SamplingParams(max_tokens=2))
    still_serves(llm)


def test_empty_prompt(llm):
    with pytest.raises(EmptyPromptError):
        llm.generate("", SamplingParams())
    with pytest.raises(EmptyPromptError):
        llm.generate([[]], SamplingParams())
    still_serves(llm)


def test_bad_token_ids(llm):
    with pytest.raises(InvalidInputError, match="token ids must be integers"):
        llm.generate([[1, 2, 10**9]], SamplingParams())
    still_serves(llm)


def test_one_bad_prompt_queues_none(llm):
    with pytest.raises(EmptyPromptError):
        llm.generate(["fine", ""], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    still_serves(llm)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    # Past 64 bits: msgpack could not carry them to the engine.
    ({"seed": 2**63}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"n": 2**64}, "n"),
    ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
])
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_too_many_logprobs(llm):
    with pytest.raises(InvalidSamplingParamsError, match="logprobs must be <= 20"):
        llm.generate("Hello", SamplingParams(logprobs=50))
    still_serves(llm)


def test_params_count_mismatch(llm):
    with pytest.raises(InvalidInputError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)


def test_unknown_architecture_names_supported_ones(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    from aserve.model.registry import MODEL_REGISTRY

    with pytest.raises(UnsupportedArchitectureError, match=", ".join(sorted(MODEL_REGISTRY))) as info:
        LLM(str(model), kv_cache_memory=1 << 24)
    assert "Gemma3ForCausalLM" in str(info.value) and "Qwen3MoeForCausalLM" in str(info.value)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(llama_dir, tmp_path, missing):
    model = shutil.copytree(llama_dir, tmp_path / "m")
    (model / missing).unlink()
    with pytest.raises(ModelFileNotFoundError, match=missing.split(".")[0]):
        LLM(str(model), kv_cache_memory=1 << 24)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_corrupt_weights(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "m")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelFileError, match="model.safetensors"):
        LLM(str(model), kv_cache_memory=1 << 24)


def test_corrupt_config(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "m")
    (model / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelFileError, match="config.json is not valid JSON"):
        LLM(str(model), kv_cache_memory=1 << 24)


def test_weights_that_do_not_fit_the_config(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptModelFileError, match="has shape"):
        LLM(str(model), kv_cache_memory=1 << 24)


def test_kv_budget_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ConfigError, match="raise kv_cache_memory or lower max_model_len"):
        LLM(str(llama_dir), kv_cache_memory=1 << 16, max_model_len=512)


def test_bad_dtype(llama_dir):
    with pytest.raises(ConfigError, match="dtype must be one of"):
        LLM(str(llama_dir), dtype="int3")
