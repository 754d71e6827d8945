"""Prompts in, validated requests out: rendering, tokenising and checking limits, once.

Every check happens here, before anything reaches the engine, so bad input raises a
typed ``InvalidInputError`` and leaves the engine untouched. :meth:`InputProcessor.prepare`
is the one call that does it, for the library (``LLM``, ``AsyncLLM.generate``) and for
the HTTP layer alike; what it returns (``PreparedPrompt``) is sent without being checked
or tokenised again.

``max_tokens`` follows one rule everywhere: ``None`` means up to ``max_model_len``, and
a prompt whose ``max_tokens`` cannot fit is refused (``PromptTooLongError`` naming
``max_tokens``, a 400 over HTTP), never cut short.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from aserve.engine.request import check_fits
from aserve.errors import EmptyPromptError, InvalidInputError, InvalidSamplingParamsError
from aserve.frontend.structured_outputs import compile_grammar
from aserve.frontend.tokenizer import Tokenizer
from aserve.sampling_params import SamplingParams
from aserve.wire.messages import EngineCoreRequest

#: A prompt: text, token ids, or vLLM's dict forms.
PromptType = Union[str, list[int], dict[str, Any]]

# vLLM's default cap on top-n logprobs (--max-logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt checked against the model and tokenised, with the parameters it will run
    with (``max_tokens`` resolved) and its compiled grammar (structured outputs);
    ``AsyncLLM.generate`` sends it as it is."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    grammar: str | None = None
    grammar_after: tuple[int, ...] = ()  # the grammar applies after these tokens (a reasoning end)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def for_model(cls, fitted: Any, tokenizer: Tokenizer) -> InputProcessor:
        """For a fitted engine config (``aserve.engine.fit.FittedConfig``): its limits, and
        the EOS ids of generation_config.json (the tokenizer's EOS when it names none)."""
        arch = fitted.arch
        eos = arch.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        return cls(tokenizer, max_model_len=fitted.config.max_model_len, vocab_size=arch.vocab_size, eos_token_ids=eos)

    def prepare(self, prompt: PromptType, params: SamplingParams, *, grammar_after: tuple[int, ...] = (),
                constraint_param: str = "structured_outputs") -> PreparedPrompt:
        """Check ``params``, compile its structured-output constraint, tokenise and check
        ``prompt``, and resolve ``max_tokens``. ``grammar_after``: token ids (a reasoning
        parser's end marker) after which the constraint applies; ``constraint_param``: the
        field a constraint that does not compile is reported as (``response_format``...).

        Raises ``InvalidSamplingParamsError``, ``StructuredOutputError`` (a constraint
        that does not compile), ``EmptyPromptError``, ``PromptTooLongError`` (the prompt,
        or the prompt plus ``max_tokens``, does not fit) or ``InvalidInputError``."""
        self.check_params(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = compile_grammar(params.structured_outputs, param=constraint_param)
        text, ids = self.tokenize(prompt)
        check_fits(len(ids), params.max_tokens, self.max_model_len)
        if params.max_tokens is None:
            room = self.max_model_len - len(ids)
            if params.min_tokens > room:
                raise InvalidSamplingParamsError(
                    f"min_tokens={params.min_tokens} does not fit: the prompt leaves room for {room} tokens",
                    param="min_tokens")
            params = msgspec.structs.replace(params, max_tokens=room)
        return PreparedPrompt(text, ids, params, grammar, grammar_after if grammar else ())

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A conversation through the chat template, as a prompt for :meth:`prepare` (the
        template already holds any BOS the model wants, so none is added again);
        ``tools``, when given, reach the template as Hugging Face templates take them."""
        if not messages:
            raise InvalidInputError("messages must not be empty", param="messages")
        extra = dict(template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "tools"):
            if reserved in extra:
                raise InvalidInputError(f"chat_template_kwargs must not set {reserved!r}", param="chat_template_kwargs")
        if tools is not None:
            extra["tools"] = tools
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

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
        check_fits(len(ids), None, self.max_model_len)
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise InvalidSamplingParamsError(f"{name} must be <= {MAX_LOGPROBS}, got {value}", param=name)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidSamplingParamsError(f"logit_bias names token {max(params.logit_bias)}; the vocabulary has "
                                             f"{self.vocab_size} tokens", param="logit_bias")

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
        grammar: str | None = None, grammar_after: tuple[int, ...] = (), max_queue_time: float | None = None,
    ) -> EngineCoreRequest:
        # The engine gets the constraint as the compiled ``grammar`` text; the request's own
        # form of it (a JSON Schema, choices) stays here. It is never needed there, and a
        # schema may hold numbers msgpack cannot carry (an integer past 64 bits).
        if params.structured_outputs is not None:
            params = msgspec.structs.replace(params, structured_outputs=None)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            priority=priority,
            grammar=grammar,
            grammar_after=list(grammar_after),
            max_queue_time=max_queue_time,
        )
