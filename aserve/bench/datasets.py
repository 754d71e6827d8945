"""Prompts for the benchmarks: ``random``, ``sharegpt`` (a local JSON file) and ``prefix``.

Each sample is a prompt (text, so any OpenAI-compatible server can take it), its length
in tokens under the benchmark's tokenizer, and the number of tokens to ask for. Random
prompts are random token ids decoded to text and cut (by re-encoding) to the length
drawn; a server with the same tokenizer sees within a token or two of that length.
Everything is drawn from ``numpy.random.default_rng(seed)``: the same flags give the
same prompts, for aserve and for vLLM alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aserve.errors import ConfigError


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ConfigError("--random-range-ratio must be in [0, 1)", param="random_range_ratio")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _random_text(tokenizer: Any, rng: np.random.Generator, length: int, vocab: int) -> tuple[str, int]:
    """Text of about ``length`` tokens from random ids (no special tokens)."""
    ids = rng.integers(0, vocab, size=length).tolist()
    text = tokenizer.decode(ids)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    if len(encoded) > length:  # decoding then encoding may merge or split: cut back to the length
        text = tokenizer.decode(encoded[:length])
        encoded = tokenizer.encode(text, add_special_tokens=False)
    return text, len(encoded)


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, prefix_len: int = 0) -> list[SampleRequest]:
    """``num_prompts`` random prompts; with ``prefix_len``, each starts with one shared
    random prefix of that many tokens (the ``prefix`` dataset: prefix caching's case)."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    prefix, prefix_tokens = _random_text(tokenizer, rng, prefix_len, vocab) if prefix_len else ("", 0)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for i in range(num_prompts):
        text, n = _random_text(tokenizer, rng, int(in_lens[i]), vocab)
        out.append(SampleRequest(prefix + text, prefix_tokens + n, int(out_lens[i])))
    return out


def sharegpt_requests(tokenizer: Any, path: str, num_prompts: int, seed: int,
                      output_len: int | None = None) -> list[SampleRequest]:
    """First human turn of each conversation as the prompt; the reply's length in tokens
    as the output length (or ``output_len``). Conversations too short or too long are
    skipped as vLLM skips them (prompt or reply under 4 tokens, prompt over 1024,
    prompt + reply over 2048)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the ShareGPT file {path!r}: {exc}", param="dataset_path") from exc
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and isinstance(turns[0].get("value"), str) and isinstance(turns[1].get("value"), str):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    order = np.random.default_rng(seed).permutation(len(pairs))
    out = []
    for k in order:
        prompt, reply = pairs[k]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        out.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(out) == num_prompts:
            break
    if len(out) < num_prompts:
        raise ConfigError(f"{path!r} has only {len(out)} usable conversations, {num_prompts} asked",
                          param="num_prompts")
    return out
