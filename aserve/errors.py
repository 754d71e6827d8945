"""The exceptions aserve raises, as one tree.

::

    AserveError
    ├── InvalidInputError (also ValueError): the caller's input is wrong; fix it and retry
    │   ├── EmptyPromptError
    │   ├── PromptTooLongError
    │   ├── InvalidSamplingParamsError
    │   ├── RequestLimitError: a request asks for more than the server's limits allow
    │   └── ConfigError: an engine setting is invalid or does not fit the model
    ├── RequestRefusedError: the server is full (admission control); retry after a while
    ├── RequestTimeoutError: a request's deadline passed; it was aborted
    ├── ModelLoadError: a model directory cannot be loaded
    │   ├── UnsupportedArchitectureError
    │   ├── UnsupportedModelFeatureError: a rope type, activation or quantization aserve lacks
    │   ├── ModelFileNotFoundError (also FileNotFoundError)
    │   └── CorruptModelFileError
    ├── EngineDeadError: an engine process died; nothing more will be served
    ├── EngineSleepingError: the engine sleeps (``sleep()``); ``wake_up()`` first
    └── HandshakeRefusedError: a headless node was refused by the front end

An ``InvalidInputError`` never leaves the engine in a bad state: the object that raised
it stays usable. Each message says what to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class AserveError(Exception):
    """Base class of every exception aserve raises on purpose."""


class InvalidInputError(AserveError, ValueError):
    """The request is malformed; nothing was sent to the engine."""

    #: Name of the offending field, where one can be named (OpenAI's ``param``).
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPromptError(InvalidInputError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidInputError):
    """The prompt (plus the tokens it asks for) does not fit ``max_model_len``."""


class InvalidSamplingParamsError(InvalidInputError):
    """A sampling parameter is out of its range."""


class RequestLimitError(InvalidInputError):
    """A request asks for more than a limit of the server allows (``n``, prompts, stop
    strings, logprobs, ``logit_bias`` entries, messages); ``param`` names the field."""


class ConfigError(InvalidInputError):
    """A configuration value is invalid or inconsistent with the model."""


class ModelLoadError(AserveError):
    """A model directory is missing something or holds something unreadable."""


class UnsupportedArchitectureError(ModelLoadError):
    """``config.json`` names an architecture aserve does not implement."""


class UnsupportedModelFeatureError(ModelLoadError):
    """``config.json`` asks for something aserve does not implement (a rope type, an
    activation, a quantization); ``field`` names the config key."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A file the model needs is not in its directory."""


class CorruptModelFileError(ModelLoadError):
    """A model file exists but cannot be parsed, or its tensors do not fit the config."""


class RequestRefusedError(AserveError):
    """Admission control refused a request: the server holds as many requests (or
    prompt tokens waiting for their prefill) as its limits allow. Nothing was rendered,
    tokenised or sent. ``reason`` names the limit; ``retry_after`` is the estimated
    seconds until there is room (an HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str, *, reason: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class RequestTimeoutError(AserveError):
    """A request's deadline passed (``request_timeout``: its whole life;
    ``max_queue_time``: waiting before its first step); it was aborted in its engine,
    whose blocks are free again after the next step. ``param`` names the deadline."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(AserveError):
    """An engine process died or stopped answering; every request in flight fails."""


class EngineSleepingError(AserveError):
    """A request reached an engine that sleeps (``sleep()``); it was refused, not queued
    (HTTP 503). ``wake_up()`` makes the engine serve again."""


class HandshakeRefusedError(AserveError):
    """The front-end node refused a headless node: a wrong DP secret, or settings that
    do not match the front end's (DP size, TP size, model, ranks)."""


@contextlib.contextmanager
def unwrap_errors() -> Iterator[None]:
    """Re-raise an ``AserveError`` that a task group wrapped in an exception group, so
    callers (and the app's handlers: 400 for bad input, 503 for a dead engine) see it."""
    try:
        yield
    except BaseExceptionGroup as group:
        for exc in group.exceptions:
            if isinstance(exc, AserveError):
                raise exc from None
        raise
