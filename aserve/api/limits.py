"""What one request may ask of the HTTP server, and how long it may take.

Each limit is a flag of ``aserve run`` (``docs/serving.md``, "Limits"). A request past one
is a 400 naming the field (:class:`aserve.errors.RequestLimitError`), checked right after
its body is parsed: before admission, rendering or tokenising, so an oversized request
costs the server nothing. vLLM bounds only ``logprobs`` by default (``--max-logprobs``
20, kept here); the other defaults are as large as a real client sends, and small
enough that no single request can hold the server: OpenAI's own bounds where it has one
(``n`` 128), aserve's otherwise.

Deadlines (off unless set): ``request_timeout`` bounds a request's whole life and
``max_queue_time`` its wait before its first engine step. A client may shorten either for
one request with the ``X-Request-Timeout`` / ``X-Max-Queue-Time`` headers (seconds); it
cannot lengthen what the server sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aserve.api.admission import AdmissionLimits
from aserve.errors import ConfigError, InvalidInputError, RequestLimitError

#: The per-request deadline headers (seconds, a positive number).
REQUEST_TIMEOUT_HEADER = "x-request-timeout"
MAX_QUEUE_TIME_HEADER = "x-max-queue-time"


@dataclass(frozen=True)
class ServerLimits:
    # Admission, across API servers (aserve.api.admission); None: no limit.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # Deadlines, in seconds; None: none.
    request_timeout: float | None = None
    max_queue_time: float | None = None
    # One request.
    max_n: int = 128
    max_prompts: int = 256  # prompts in one completions request
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters of one stop string
    max_logprobs: int = 20  # logprobs / top_logprobs (vLLM's --max-logprobs)
    max_logit_bias: int = 1024  # logit_bias entries
    max_messages: int = 1024  # chat messages
    max_message_chars: int = 1 << 20  # characters of all messages' content together

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}", param=name)
        for name in ("request_timeout", "max_queue_time"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}", param=name)
        for name in ("max_n", "max_prompts", "max_stop", "max_stop_chars", "max_logprobs", "max_logit_bias",
                     "max_messages", "max_message_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}", param=name)

    @property
    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_num_queued_reqs, self.max_num_queued_tokens)

    def deadline(self, headers: Any, header: str, server: float | None, param: str) -> float | None:
        """The deadline of one request: the server's, shortened by ``header`` if the
        request sends it; InvalidInputError naming ``param`` for a bad value."""
        raw = headers.get(header)
        if raw is None:
            return server
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise InvalidInputError(f"the {header} header must be a positive number of seconds, got {raw!r}",
                                    param=param)
        return value if server is None else min(server, value)


@dataclass(frozen=True)
class Deadlines:
    """One request's deadlines: ``expires_at`` on ``time.monotonic``'s clock (from
    ``request_timeout``), and ``max_queue_time`` for its engine requests; None: none."""

    request_timeout: float | None = None
    expires_at: float | None = None
    max_queue_time: float | None = None

    @classmethod
    def of(cls, limits: ServerLimits, headers: Any, start: float) -> Deadlines:
        """The server's deadlines, shortened by the request's headers; InvalidInputError
        for a header that is not a positive number."""
        timeout = limits.deadline(headers, REQUEST_TIMEOUT_HEADER, limits.request_timeout, "request_timeout")
        queue = limits.deadline(headers, MAX_QUEUE_TIME_HEADER, limits.max_queue_time, "max_queue_time")
        return cls(timeout, None if timeout is None else start + timeout, queue)


def _over(limits: ServerLimits, field: str, value: int, limit_name: str, what: str) -> None:
    limit = getattr(limits, limit_name)
    if value > limit:
        flag = "--" + limit_name.replace("_", "-")
        raise RequestLimitError(f"{what} is {value}; this server allows at most {limit} ({flag})", param=field)


def check_sampling(limits: ServerLimits, req: Any) -> None:
    """The limits every generation request shares (``n``, stop strings, ``logit_bias``)."""
    _over(limits, "n", req.n, "max_n", "n")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _over(limits, "stop", len(stop), "max_stop", "the number of stop strings")
    _over(limits, "stop", max((len(s) for s in stop), default=0), "max_stop_chars", "the longest stop string")
    if req.logit_bias:
        _over(limits, "logit_bias", len(req.logit_bias), "max_logit_bias", "the number of logit_bias entries")


def check_completion(limits: ServerLimits, req: Any, num_prompts: int) -> None:
    check_sampling(limits, req)
    _over(limits, "prompt", num_prompts, "max_prompts", "the number of prompts")
    if req.logprobs is not None:
        _over(limits, "logprobs", req.logprobs, "max_logprobs", "logprobs")


def check_chat(limits: ServerLimits, req: Any) -> None:
    check_sampling(limits, req)
    if req.top_logprobs is not None:
        _over(limits, "top_logprobs", req.top_logprobs, "max_logprobs", "top_logprobs")
    _over(limits, "messages", len(req.messages), "max_messages", "the number of messages")
    chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content:
            chars += sum(len(str(part.get("text", ""))) for part in content)
    _over(limits, "messages", chars, "max_message_chars", "the messages' content, in characters,")
