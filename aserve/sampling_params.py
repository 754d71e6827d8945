"""``SamplingParams``: how to pick each next token, and when to stop.

The same struct is used by the library API, the HTTP layer and (later) the wire to the
engine core, so it is a ``msgspec.Struct`` with the wire options: encoded as an array, not
tracked by the garbage collector (see ``aserve.wire.messages``). Field names and meanings follow
vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import enum

import msgspec

from aserve.errors import InvalidSamplingParamsError

# Temperatures below this are greedy decoding (as in vLLM): dividing by them would
# overflow, and users write 0 to mean "greedy".
GREEDY_EPSILON = 1e-5

#: ``max_tokens`` when a request does not say: OpenAI's and vLLM's default for
#: completions (a chat request without it runs up to ``max_model_len``).
DEFAULT_MAX_TOKENS = 16

#: The integers a request may carry to an engine. Requests cross to the engine cores as
#: msgpack, which holds integers of 64 bits at most, and a seed seeds a torch generator;
#: vLLM bounds ``seed`` the same way. Past these a request is refused by name, where it
#: would otherwise fail to encode after it had been accepted.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_int64(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) that fits 64 signed bits."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


class RequestOutputKind(enum.IntEnum):
    """What each streamed ``RequestOutput`` holds."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON Schema (an object, or its JSON text);
    - ``json_object``: any JSON object;
    - ``regex``: a regular expression (Rust's ``regex`` syntax) the whole output matches;
    - ``choice``: one of these strings, exactly;
    - ``grammar``: a context-free grammar, in llguidance's Lark dialect or in GBNF
      (``root ::= ...``, llama.cpp's and xgrammar's EBNF form).

    JSON is generated compact (``,`` and ``:``, no free-running whitespace) unless
    ``disable_any_whitespace`` is False, so a weak model still reaches the closing brace.
    The grammar is compiled, and refused with a named error, before the request is sent
    (``aserve.frontend.structured_outputs``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) or "none"), param="structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidSamplingParamsError("structured_outputs.choice must be a list of non-empty strings",
                                             param="structured_outputs")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling and stopping parameters of one request.

    Raises :class:`aserve.errors.InvalidSamplingParamsError` on construction when a
    value is out of range; the message names the field and the allowed range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.is_greedy:
            # Filters make no difference to an argmax; dropping them keeps greedy rows
            # on the cheap path of the sampler.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def _verify(self) -> None:
        def fail(param: str, message: str) -> None:
            raise InvalidSamplingParamsError(f"{param} {message}", param=param)

        if not is_int64(self.n) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not is_int64(self.top_k) or self.top_k < 0:
            fail("top_k", f"must be -1 or 0 (disabled) or a positive 64-bit integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not is_int64(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", f"must be a 64-bit integer >= 1, got {self.max_tokens!r}")
        if not is_int64(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", f"must be a 64-bit integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int64(value) or value < 0):
                fail(name, f"must be a 64-bit integer >= 0, got {value!r}")
        if self.seed is not None and not is_int64(self.seed):
            fail("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.stop is not None:
            if not all(isinstance(s, str) for s in self.stop):
                fail("stop", "must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                fail("stop", "must not contain an empty string")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int64(t) and t >= 0 and isinstance(b, (int, float))
                    and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
                fail("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        if self.stop_token_ids is not None and not all(is_int64(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative 64-bit integers")
