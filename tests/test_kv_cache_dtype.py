"""``kv_cache_dtype`` (``--kv-cache-dtype``): keys and values stored in another dtype than
the model computes in, checked against transformers in float32."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM
from aserve.cli import build_parser
from aserve.engine.fit import fit_config
from aserve.errors import ConfigError
from aserve.engine.args import EngineArgs
from tests.hf_reference import GREEDY, PROMPTS, hf_logprobs, load_hf



def test_bad_kv_cache_dtype_names_its_field(llama_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of") as bad:
        EngineArgs(str(llama_dir), kv_cache_dtype="int8").create_engine_config()
    assert bad.value.param == "kv_cache_dtype"
    with pytest.raises(ConfigError, match="no fp8 KV cache on CPU"):
        EngineArgs(str(llama_dir), kv_cache_dtype="fp8_e4m3").create_engine_config()
    assert build_parser().parse_args(["run", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--kv-cache-dtype", "fp8"])


def test_a_bf16_cache_holds_twice_the_tokens_of_a_float32_one(llama_dir):
    auto = fit_config(EngineArgs(str(llama_dir), dtype="float32", kv_cache_memory=1 << 22).create_engine_config()).config
    half = fit_config(EngineArgs(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16",
                                         kv_cache_memory=1 << 22).create_engine_config()).config
    assert auto.cache.kv_cache_dtype == "float32"  # "auto": the model's, resolved once
    assert (half.model.dtype, half.cache.kv_cache_dtype) == ("float32", "bfloat16")
    assert half.cache.num_blocks == 2 * auto.cache.num_blocks


@pytest.fixture(scope="module")
def hf_and_prompts(llama_dir):
    tokenizer = LLM(str(llama_dir), kv_cache_memory=1 << 22).get_tokenizer()
    return load_hf(llama_dir), [tokenizer.encode(p) for p in PROMPTS]


def _generate(llama_dir, prompts, **kwargs):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=1 << 24,
              max_num_batched_tokens=32, **kwargs)  # chunked prefills: later chunks read the cache
    return llm, llm.generate(prompts, GREEDY)


def test_bf16_cache_under_a_float32_model_stays_close_to_transformers(llama_dir, hf_and_prompts):
    hf, prompts = hf_and_prompts
    llm, outputs = _generate(llama_dir, prompts)
    runner = llm.engine.executor.worker.runner
    assert runner.kv_caches[0].paged.dtype == torch.bfloat16
    assert runner.decode_kernel is not None and runner.model_dtype == torch.float32
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + tokens[:-1])  # float32, nothing rounded
        for i, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + i]
            # The reference's greedy choice, up to a near-tie that bf16 keys may flip.
            assert float(row.max() - row[token]) < 0.02
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=0.02)


def test_the_c_kernel_and_the_torch_path_read_the_same_stored_values(llama_dir, hf_and_prompts, monkeypatch):
    _, prompts = hf_and_prompts
    _, with_kernel = _generate(llama_dir, prompts)
    monkeypatch.setenv("ASERVE_CPU_ATTENTION", "sdpa")
    llm, plain = _generate(llama_dir, prompts)
    assert llm.engine.executor.worker.runner.decode_kernel is None
    for a, b in zip(with_kernel, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


def test_tensor_parallel_workers_store_the_requested_dtype(llama_dir, hf_and_prompts):
    """The dtype reaches worker processes: TP = 2 gives TP = 1's tokens and logprobs (here
    within 6e-6 of each other, against 1.5e-3 to 2.9e-3 between a bf16 and a float32 cache)."""
    _, prompts = hf_and_prompts
    _, single = _generate(llama_dir, prompts)
    llm, sharded = _generate(llama_dir, prompts, tensor_parallel_size=2)
    with llm:
        assert llm.engine.config.cache.kv_cache_dtype == "bfloat16"
    for a, b in zip(single, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
