"""OpenAI request bodies, parsed and checked, and the SamplingParams they ask for.

Bodies are decoded with msgspec into typed structs (unknown fields are ignored, as the
OpenAI API and vLLM do); a wrong type or value raises :class:`RequestError` naming the
field, which the app turns into a 400 with OpenAI's error body. vLLM's extra sampling
fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ...) are accepted in the body.
"""

from __future__ import annotations

from typing import Any

import msgspec

from aserve.errors import InvalidInputError
from aserve.sampling_params import DEFAULT_MAX_TOKENS, RequestOutputKind, SamplingParams


class RequestError(InvalidInputError):
    """A request body that is not valid JSON or breaks the schema: a 400."""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    data_parallel_rank: int | None = None  # pin an engine (also the X-data-parallel-rank header)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (``max_tokens`` None: up to ``max_model_len``);
        InvalidSamplingParamsError names a bad field."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked in prompts()
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # null too: OpenAI's completions default
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                return [list(p)]
            if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
                return [list(x) for x in p]
        raise RequestError("prompt must be a string, a list of strings, a list of token ids, or a list of those",
                           param="prompt")


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"content part type {part.get('type')!r} is not supported; only 'text'",
                                   param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """Parse a request body; RequestError with the offending field as ``param``."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "`$." in message else None
        raise RequestError(message, param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
