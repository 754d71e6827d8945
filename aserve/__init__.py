"""aserve: an LLM inference server with the OpenAI HTTP API.

The public API is re-exported here; everything else is internal.
"""

from aserve.errors import (
    AserveError,
    EngineDeadError,
    InvalidInputError,
    ModelLoadError,
)
from aserve.frontend.async_llm import AsyncLLM
from aserve.frontend.llm import LLM
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AserveError",
    "AsyncLLM",
    "CompletionOutput",
    "EngineDeadError",
    "InvalidInputError",
    "LLM",
    "Logprob",
    "ModelLoadError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
