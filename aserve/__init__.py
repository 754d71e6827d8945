"""aserve: an LLM inference server with the OpenAI HTTP API.

The public API is re-exported here, lazily: ``from aserve import LLM`` imports the
offline engine, and nothing else is loaded until it is asked for, so a spawned engine
core, coordinator or worker (which imports ``aserve`` as the package of its own modules)
loads none of the front end. Everything not listed in ``__all__`` is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "AserveError": "aserve.errors",
    "AsyncLLM": "aserve.frontend.async_llm",
    "CompletionOutput": "aserve.outputs",
    "EngineArgs": "aserve.engine.args",
    "EngineDeadError": "aserve.errors",
    "InvalidInputError": "aserve.errors",
    "LLM": "aserve.frontend.llm",
    "Logprob": "aserve.outputs",
    "ModelLoadError": "aserve.errors",
    "RequestOutput": "aserve.outputs",
    "RequestOutputKind": "aserve.sampling_params",
    "SamplingParams": "aserve.sampling_params",
}

__all__ = [
    "AserveError",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "InvalidInputError",
    "LLM",
    "Logprob",
    "ModelLoadError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
assert __all__ == sorted(_EXPORTS), "every export is listed once, in order"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from aserve.engine.args import EngineArgs
    from aserve.errors import AserveError, EngineDeadError, InvalidInputError, ModelLoadError
    from aserve.frontend.async_llm import AsyncLLM
    from aserve.frontend.llm import LLM
    from aserve.outputs import CompletionOutput, Logprob, RequestOutput
    from aserve.sampling_params import RequestOutputKind, SamplingParams
