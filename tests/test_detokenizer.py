"""Incremental detokenization and the output processor's text handling."""

from __future__ import annotations

import pytest

from aserve.frontend.detokenizer import IncrementalDetokenizer
from aserve.frontend.output_processor import OutputProcessor, RequestState
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.wire.messages import EngineCoreOutput, FinishReason

TEXT = "héllo wörld: 日本語 and 😀 emoji, naïve café"


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from aserve.frontend.tokenizer import Tokenizer

    return Tokenizer(llama_dir)


def test_multibyte_characters_split_over_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) // 2  # byte-level: multi-byte chars span tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens completed no character


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert skip.push(ids) + skip.flush() == "hi"
    assert keep.push(ids) + keep.flush() == "hi</s>"


def feed(tokenizer, params, ids, prompt=(0,)):
    proc = OutputProcessor()
    state = RequestState("r", None, list(prompt), params, tokenizer)
    proc.add(state)
    results, aborts = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs, ab = proc.process([EngineCoreOutput("r", [t], finish_reason=FinishReason.LENGTH if last else None)])
        results += outs
        aborts += ab
        if ab:
            break
    return results, aborts


def test_delta_outputs_concatenate_to_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    results, _ = feed(tokenizer, SamplingParams(output_kind=RequestOutputKind.DELTA), ids)
    assert "".join(r.outputs[0].text for r in results) == TEXT
    assert sum((r.outputs[0].token_ids for r in results), []) == ids
    assert results[-1].finished and results[-1].outputs[0].finish_reason == "length"


def test_stop_string_split_over_tokens_is_never_streamed(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, stop=["日本"])
    results, aborts = feed(tokenizer, params, ids)
    streamed = "".join(r.outputs[0].text for r in results)
    assert streamed == "héllo wörld: "
    assert aborts == ["r"]  # the engine must stop the request
    assert results[-1].outputs[0].finish_reason == "stop" and results[-1].outputs[0].stop_reason == "日本"


def test_cumulative_outputs_grow(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    results, _ = feed(tokenizer, SamplingParams(output_kind=RequestOutputKind.CUMULATIVE), ids)
    texts = [r.outputs[0].text for r in results]
    assert texts[-1] == "hello world"
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))


def test_final_only_emits_once(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    results, _ = feed(tokenizer, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), ids)
    assert len(results) == 1 and results[0].outputs[0].text == "hello world"
