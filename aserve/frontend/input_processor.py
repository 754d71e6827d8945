"""Prompts in, validated ``EngineCoreRequest``s out: tokenising and checking limits.

Every check happens here, before anything reaches the engine, so bad input raises a
typed ``InvalidInputError`` and leaves the engine untouched.
"""

from __future__ import annotations

import time
from typing import Any, Union

from aserve.errors import EmptyPromptError, InvalidInputError, InvalidSamplingParamsError, PromptTooLongError
from aserve.sampling_params import SamplingParams
from aserve.tokenizer import Tokenizer
from aserve.wire.messages import EngineCoreRequest

#: A prompt: text, token ids, or vLLM's dict forms.
PromptType = Union[str, list[int], dict[str, Any]]

# vLLM's default cap on top-n logprobs (--max-logprobs).
MAX_LOGPROBS = 20


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def for_model(cls, fitted: Any, tokenizer: Tokenizer) -> InputProcessor:
        """For a fitted engine config (``engine_core.FittedConfig``): its limits, and the
        EOS ids of generation_config.json (the tokenizer's EOS when it names none)."""
        arch = fitted.arch
        eos = arch.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        return cls(tokenizer, max_model_len=fitted.config.max_model_len, vocab_size=arch.vocab_size, eos_token_ids=eos)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), validated."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise InvalidInputError("a dict prompt needs 'prompt' or 'prompt_token_ids'", param="prompt")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise InvalidInputError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}", param="prompt")
        if ids is None:
            if not isinstance(text, str):
                raise InvalidInputError("'prompt' must be a string", param="prompt")
            if text == "":
                raise EmptyPromptError("the prompt is empty; give at least one character or token", param="prompt")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise EmptyPromptError("the prompt has no tokens; give at least one", param="prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidInputError(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, which must leave room "
                "for at least one generated token; shorten the prompt or raise max_model_len",
                param="prompt",
            )
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise InvalidSamplingParamsError(f"{name} must be <= {MAX_LOGPROBS}, got {value}", param=name)

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
    ) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            priority=priority,
        )
