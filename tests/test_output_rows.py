"""The last layer computes only the rows that sample (``LlamaModel.forward``'s
``output_rows``): every token's keys and values are still cached, the outputs are those
of the whole computation, and a request asking for prompt logprobs keeps every row."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM, SamplingParams

PROMPTS = [
    [5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 8, 150, 22, 9],
    [11, 4, 99, 23, 6],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
]


class RowCounter:
    """Per forward of the model: (tokens in, rows out, rows the last layer's MLP took)."""

    def __init__(self, llm: LLM) -> None:
        model = llm.engine.executor.worker.runner.model.model
        self.calls: list[tuple[int, int, int | None]] = []
        self._last_mlp: int | None = None
        model.layers[-1].mlp.register_forward_pre_hook(self._mlp)
        model.register_forward_hook(self._model)

    def _mlp(self, module: torch.nn.Module, args: tuple) -> None:
        self._last_mlp = args[0].shape[0]

    def _model(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.calls.append((args[0].shape[0], out.shape[0], self._last_mlp))
        self._last_mlp = None


@pytest.mark.parametrize("arch", ["llama", "olmo2", "gemma2", "qwen2_moe"])  # pre, post, sandwich norms; experts
def test_the_last_layer_runs_only_the_rows_that_sample(arch, model_dirs):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # A 7-token budget splits the prompts into chunks that share steps with decodes, and
    # gives steps where no row samples (a chunk in the middle of a prompt).
    llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, max_num_batched_tokens=7)
    counter = RowCounter(llm)
    pruned = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    prefill_calls = [c for c in counter.calls if c[2] is not None and c[0] > len(PROMPTS)]
    assert prefill_calls, "no step ran its prompt tokens through the layers"
    for tokens, rows, last_mlp in counter.calls:
        if last_mlp is not None:  # the one-call decode stack has no per-layer modules
            assert last_mlp == rows
        assert rows <= tokens
    assert any(rows < tokens for tokens, rows, _ in counter.calls)
    # A step of chunks that none of them finish keeps one row (no kernel sees zero rows).
    assert any(rows == 1 and tokens == 7 for tokens, rows, _ in counter.calls)

    # The same requests with every row computed (a request asking for prompt logprobs
    # keeps every row in its steps) give the same tokens.
    full = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 24, max_num_batched_tokens=7)
    full_counter = RowCounter(full)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    outputs = full.generate([{"prompt_token_ids": p} for p in PROMPTS], with_logprobs)
    assert [o.outputs[0].token_ids for o in outputs] == pruned
    assert all(rows == tokens for tokens, rows, _ in full_counter.calls)
    assert [len(o.prompt_logprobs) for o in outputs] == [len(p) for p in PROMPTS]


def test_a_step_with_one_request_asking_for_prompt_logprobs_keeps_every_row(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory=1 << 24)
    counter = RowCounter(llm)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [plain, asking])
    first_step = counter.calls[0]
    assert first_step[0] == first_step[1] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert outputs[0].prompt_logprobs is None
    assert len(outputs[1].prompt_logprobs) == len(PROMPTS[1])
    # Alone, the first request's prompt runs pruned, and samples the same tokens.
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], plain)[0]
    assert counter.calls[-2][:2] == (len(PROMPTS[0]), 1)
    assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids
