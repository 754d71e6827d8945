"""``aserve bench throughput`` and ``aserve bench latency``: the engine through ``LLM``.

throughput: every prompt at once through ``LLM.generate``; requests/s and tokens/s.
latency: one batch of ``batch_size`` prompts, generated ``num_iters`` times after
``num_iters_warmup``; the batch's latency and the time per decode step
(latency / output_len). The prefix cache is emptied before every run, so each one pays
for its prefill (the same prompts would otherwise hit the cache after the first run);
``cached_prompt_tokens`` (0) says so in the result.

The JSON keys are vLLM's (``elapsed_time``, ``requests_per_second``,
``tokens_per_second``; ``avg_latency``, ``latencies``, ``percentiles``), plus
``output_tokens_per_second``, ``avg_step_ms`` and ``cached_prompt_tokens``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from aserve.sampling_params import SamplingParams


def _prompts(vocab: int, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=input_len).tolist() for _ in range(n)]


def throughput(llm: Any, *, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    prompts = _prompts(llm.get_tokenizer().vocab_size, num_prompts, input_len, seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = out_tokens + sum(len(p) for p in prompts)
    return {"elapsed_time": elapsed, "num_requests": num_prompts, "total_num_tokens": total,
            "requests_per_second": num_prompts / elapsed, "tokens_per_second": total / elapsed,
            "output_tokens_per_second": out_tokens / elapsed}


def latency(llm: Any, *, batch_size: int, input_len: int, output_len: int, num_iters_warmup: int = 1,
            num_iters: int = 3, seed: int = 0) -> dict[str, Any]:
    prompts = _prompts(llm.get_tokenizer().vocab_size, batch_size, input_len, seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for _ in range(num_iters_warmup):
        llm.reset_prefix_cache()
        llm.generate(prompts, params)
    latencies, cached = [], 0
    for _ in range(num_iters):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        latencies.append(time.perf_counter() - start)
        cached += sum(o.num_cached_tokens for o in outputs)
    arr = np.asarray(latencies)
    return {"avg_latency": float(arr.mean()), "latencies": latencies,
            "percentiles": {str(p): float(np.percentile(arr, p)) for p in (10, 25, 50, 75, 90, 99)},
            "avg_step_ms": float(arr.mean()) * 1000 / output_len, "cached_prompt_tokens": cached}
