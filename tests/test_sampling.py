"""Every sampling parameter changes the output the way it should."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from aserve import LLM, SamplingParams
from tests.hf_reference import load_hf

PROMPT = "The quick brown fox jumps over the lazy dog. A language model reads"
OTHERS = ["Hello world", "What is the capital of France? Paris is the capital", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory=1 << 24, seed=1)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return load_hf(llama_dir)


def tokens(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0].token_ids


def test_seed_reproducible_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    batched = llm.generate([*OTHERS, PROMPT], [SamplingParams(temperature=0.9, max_tokens=30)] * 3 + [params])
    assert batched[3].outputs[0].token_ids == alone
    other_seed = tokens(llm, PROMPT, temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert other_seed != alone


def test_seed_reproducible_across_preemption(llama_dir):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    roomy = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    prompt = "Once upon a time"  # short: all four start at once, then outgrow the pool
    expected = [o.outputs[0].token_ids for o in roomy.generate([prompt] * 4, params)]
    per_block = 2 * 2 * 4 * 2 * 32 * 4
    tight = LLM(str(llama_dir), kv_cache_memory=20 * per_block, block_size=4, max_model_len=72,
                enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate([prompt] * 4, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_unseeded_sampling_varies(llm):
    runs = {tuple(tokens(llm, PROMPT, temperature=1.5, max_tokens=12, ignore_eos=True)) for _ in range(3)}
    assert len(runs) > 1


def test_filters_that_leave_one_token_are_greedy(llm):
    greedy = tokens(llm, PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    assert tokens(llm, PROMPT, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True) == greedy
    assert tokens(llm, PROMPT, temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True) == greedy
    assert tokens(llm, PROMPT, temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True) == greedy


def test_top_k_keeps_samples_within_the_k_most_likely(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=2.0, top_k=3, seed=5, max_tokens=30, logprobs=0,
                                              ignore_eos=True))[0].outputs[0]
    ranks = [pos[tok].rank for pos, tok in zip(out.logprobs, out.token_ids)]
    assert max(ranks) <= 3
    assert max(ranks) > 1  # at temperature 2 it does not always take the top token


def test_logprobs_match_transformers(llm, hf):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    total = 0.0
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert position[token].rank == 1
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = torch.topk(row, 3)
        assert set(position) == set(top.indices.tolist())  # the greedy token is also the top one
        assert position[token].decoded_token == llm.get_tokenizer().decode([token], skip_special_tokens=False)
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_repetition_penalty_matches_transformers(llm, hf):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    got = tokens(llm, prompt_ids, temperature=0, repetition_penalty=1.8, max_tokens=16, ignore_eos=True)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt_ids]), do_sample=False, repetition_penalty=1.8, max_new_tokens=16,
                          min_new_tokens=16, pad_token_id=2)[0, len(prompt_ids):].tolist()
    assert got == ref
    assert got != tokens(llm, prompt_ids, temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.7), (-0.5, 0.3)])
def test_presence_and_frequency_penalties_match_reference(llm, hf, presence, frequency):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    got = tokens(llm, prompt_ids, temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                 max_tokens=16, ignore_eos=True)
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(16):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    assert got == out


def test_stop_token_ids_and_min_tokens(llm):
    greedy = tokens(llm, PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    first = greedy[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first], min_tokens=4,
                                               ignore_eos=True))[0].outputs[0]
    assert first not in held.token_ids[:4]
    assert len(held.token_ids) > 4


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


def test_eos_stops_unless_ignored(llama_dir, tmp_path, llm):
    first = tokens(llm, PROMPT, temperature=0, max_tokens=1)[0]
    model = shutil.copytree(llama_dir, tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    eos_llm = LLM(str(model), kv_cache_memory=1 << 24)
    out = eos_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason is None
    ignored = eos_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 8 and ignored.finish_reason == "length"


def test_stop_strings_cut_the_text(llm):
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_n_samples(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    greedy = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_temperature_spreads_the_distribution(llm):
    def distinct(temp):
        out = llm.generate(PROMPT, SamplingParams(n=8, temperature=temp, seed=3, max_tokens=1))[0]
        return len({c.token_ids[0] for c in out.outputs})

    assert distinct(0.05) < distinct(5.0)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    expected = tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 4
