"""OpenAI request bodies, parsed and checked, and the SamplingParams they ask for.

Bodies are decoded with msgspec into typed structs; a wrong type or value raises
:class:`RequestError` naming the field, which the app turns into a 400 with OpenAI's
error body. A top-level field aserve does not implement is refused the same way (a 400
naming it), never silently ignored (vLLM ignores them with a log line); fields inside a
message are not checked, since clients send back the assistant messages they received,
with whatever fields those carried, but its content must be a string or text parts. vLLM's extra sampling
fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ...) are accepted in the body, and so are the output
constraints (``response_format``, ``structured_outputs``, ``guided_*``:
docs/structured-outputs.md).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from aserve.errors import InvalidInputError
from aserve.sampling_params import (
    DEFAULT_MAX_TOKENS,
    INT64_MAX,
    INT64_MIN,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

#: ``priority``'s range (``aserve.sampling_params.is_int64`` says why), checked as the
#: body is decoded: the sampling fields' ranges are ``SamplingParams``'s, but priority is
#: no sampling field, and the engine's own check in ``AsyncLLM.generate`` would come after
#: a stream's first chunk.
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class RequestError(InvalidInputError):
    """A request body that is not valid JSON or breaks the schema: a 400."""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # aserve always holds the output to the schema


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True


#: Grammar backends a request may name: aserve matches with llguidance ("guidance" is
#: vLLM's name for it); naming another is refused rather than silently not honoured.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    n: int = 1
    best_of: int | None = None  # vLLM's benchmark client sends 1; only n (or None) is accepted
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
    priority: Int64 = 0
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as OpenAI sends) -> bias
    data_parallel_rank: int | None = None  # pin an engine (also the X-data-parallel-rank header)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the
    # older top-level guided_* fields that clients still send.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def output_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the one output constraint the body asks for), or
        None for free text; a RequestError naming the field when the body asks for more
        than one, or for what is not supported."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None:
            if fmt.type == "json_object":
                asked.append(("response_format", StructuredOutputsParams(json_object=True)))
            elif fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.schema is None:
                    raise RequestError("response_format of type json_schema needs json_schema.schema",
                                       param="response_format")
                asked.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.schema)))
            elif fmt.type != "text":
                raise RequestError(f"response_format.type must be text, json_object or json_schema, not {fmt.type!r}",
                                   param="response_format")
        if self.structured_outputs is not None:
            body = self.structured_outputs
            try:
                asked.append(("structured_outputs", StructuredOutputsParams(
                    json=body.json, regex=body.regex, choice=body.choice, grammar=body.grammar,
                    json_object=body.json_object, disable_any_whitespace=body.disable_any_whitespace)))
            except InvalidInputError as exc:
                raise RequestError(str(exc), param="structured_outputs") from None
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                try:
                    asked.append((name, StructuredOutputsParams(**{name.removeprefix("guided_"): value})))
                except InvalidInputError as exc:
                    raise RequestError(str(exc).replace("structured_outputs", name), param=name) from None
        if len(asked) > 1:
            raise RequestError(f"give one output constraint, not {' and '.join(n for n, _ in asked)}",
                               param=asked[1][0])
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GRAMMAR_BACKENDS:
            raise RequestError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: aserve "
                               "matches grammars with llguidance ('guidance' or 'auto')", param="guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise RequestError("guided_whitespace_pattern is not supported: JSON is compact, or free with "
                               "structured_outputs.disable_any_whitespace=false", param="guided_whitespace_pattern")
        return asked[0] if asked else None

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (``max_tokens`` None: up to ``max_model_len``);
        InvalidSamplingParamsError names a bad field."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of={self.best_of} is not supported: aserve returns every one of n samples "
                               "(leave best_of out, or equal to n)", param="best_of")
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
            structured_outputs=constraint[1] if (constraint := self.output_constraint()) else None,
            logit_bias=self.token_biases(),
        )

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids; a RequestError naming it for a key that
        is not one."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): float(bias) for token, bias in self.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None

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


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


class NamedToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedToolChoiceFunction


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"content part type {part.get('type')!r} is not supported; only 'text'",
                                   param="messages")
            text = part.get("text")
            if not isinstance(text, str):
                # As OpenAI answers it: a text part without a string is not rendered as "" or "[]".
                raise RequestError("a text content part needs 'text', a string"
                                   + ("" if text is None else f", not {type(text).__name__}"), param="messages")
            parts.append(text)
        return "".join(parts)


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``/tokenize``: a ``prompt``, or ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """Parse a request body; RequestError with the offending field as ``param``."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith("Object contains unknown field `") and " - at `" not in message:
            field = message.split("`")[1]
            raise RequestError(f"unknown field `{field}`: aserve does not implement it", param=field) from None
        param = message.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "`$." in message else None
        raise RequestError(message, param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
