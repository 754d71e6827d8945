"""Greedy tokens and logprobs match transformers on every architecture and variant."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_logprobs, load_hf
from tests.models import EAGER, VARIANTS

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. A language model reads a sequence",
    "What is the capital of France?",
    "Once upon a time there was a small town by the sea. The people of the town were fishers and bakers, "
    "teachers and builders. In the morning the boats went out",
]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def references(model_dirs):
    refs = {}
    for name, path in model_dirs.items():
        hf = load_hf(path, eager=name in EAGER)
        llm_tok = LLM(str(path), kv_cache_memory=1 << 24).get_tokenizer()
        prompts = [llm_tok.encode(p) for p in PROMPTS]
        refs[name] = (prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts], hf)
    return refs


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_greedy_batch_matches_transformers(arch, model_dirs, references):
    prompts, expected, _ = references[arch]
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_chunked_prefill_matches_transformers(arch, model_dirs, references):
    prompts, expected, _ = references[arch]
    # A 7-token budget forces every prompt into several chunks that share steps with
    # other requests' decodes.
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, max_num_batched_tokens=7)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


#: The prefix-cache and preemption tests run on every architecture: sliding windows
#: (local layers of 8 tokens, prompts up to 48), soft-capping, NoPE layers and experts
#: all change how a chunk reads its cached context.
CACHE_ARCHS = sorted(VARIANTS)


@pytest.mark.parametrize("arch", CACHE_ARCHS)
def test_prefix_cache_hit_gives_same_tokens(arch, model_dirs, references):
    prompts, expected, _ = references[arch]
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, block_size=4)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    # Every full block of each prompt except the last token's was found in the cache.
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert all(o.num_cached_tokens == 0 for o in first)


@pytest.mark.parametrize("arch", CACHE_ARCHS)
def test_preemption_recomputes_to_same_tokens(arch, model_dirs, references):
    from aserve.model.hf_config import load_arch_config
    from aserve.model.kv_spec import bytes_per_block

    prompts, expected, _ = references[arch]
    # 22 usable blocks of 4 tokens: the longest request alone needs 21 by its end, so
    # the four cannot all hold their KV at once and some are preempted and recomputed.
    per_block = bytes_per_block(load_arch_config(model_dirs[arch]), tp_size=1, dtype="float32", block_size=4)
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=23 * per_block, block_size=4, max_model_len=88)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sharded_checkpoint_loads_same_weights(sharded_llama_dir, references):
    assert len(list(sharded_llama_dir.glob("model-*-of-*.safetensors"))) > 1
    prompts, expected, _ = references["llama"]
    llm = LLM(str(sharded_llama_dir), kv_cache_memory=1 << 24)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_prompt_logprobs_close_to_transformers(arch, model_dirs, references):
    prompts, _, hf = references[arch]
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, max_num_batched_tokens=16)
    out = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    ref = hf_logprobs(hf, prompts[3])
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompts[3])
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        actual = prompts[3][pos]
        assert entry[actual].logprob == pytest.approx(float(ref[pos - 1, actual]), abs=1e-4)
        top = torch.topk(ref[pos - 1], 3)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logprobs_close_to_float32_reference(dtype, llama_dir, references):
    prompts, _, hf = references["llama"]
    llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory=1 << 24)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ref = hf_logprobs(hf, prompts[1])
    errors = [abs(entry[prompts[1][pos]].logprob - float(ref[pos - 1, prompts[1][pos]]))
              for pos, entry in enumerate(out.prompt_logprobs[1:], start=1)]
    assert max(errors) < 0.1


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_tensor_parallel_2_matches_transformers(arch, model_dirs, references):
    # Covers vocabulary-parallel embedding and LM head (tied or not), sharded biases,
    # q/k norm, and KV heads replicated when TP exceeds them (qwen2 has one KV head).
    prompts, expected, _ = references[arch]
    with LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, tensor_parallel_size=2, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, GREEDY)
        instance_id, instance_dir = llm._instance.id, llm._instance.dir
        assert [o.outputs[0].token_ids for o in outputs] == expected
    import os
    from pathlib import Path

    assert not list(Path("/dev/shm").glob(f"{instance_id}_*"))
    assert not os.path.exists(instance_dir)


def _thread_names(pid: int) -> list[str]:
    from pathlib import Path

    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            continue
    return names


@pytest.mark.parametrize("tp_comm", ["shm", "gloo"])
def test_both_tp_comms_match_transformers_and_only_gloo_keeps_its_threads(tp_comm, model_dirs, references):
    # gloo keeps a TCP loop thread per process that wakes every 10 ms while its group
    # lives; the shared-memory path releases the group after set-up.
    prompts, expected, _ = references["llama"]
    with LLM(str(model_dirs["llama"]), kv_cache_memory=1 << 24, tensor_parallel_size=2, tp_comm=tp_comm) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        workers = llm.engine.executor.workers
        assert len(workers) == 2
        gloo_threads = [name for w in workers for name in _thread_names(w.pid) if "gloo" in name]
        if tp_comm == "gloo":
            assert len(gloo_threads) >= 2
        else:
            assert gloo_threads == []
