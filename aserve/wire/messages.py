"""Messages between the front end (``LLM``, API servers) and the engine core.

All are ``msgspec.Struct``s declared ``array_like=True, omit_defaults=True, gc=False``:
encoded as msgpack arrays (field order is the protocol, no field names are sent) and
never tracked by the garbage collector. msgspec 0.2x still writes the trailing
defaults of array-like structs (measured: ``omit_defaults`` has no effect there), but
decoders accept a body that leaves them out, so the option is kept for when it does. Text never crosses this boundary: the engine
core sees token ids only, and the front end detokenises.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from aserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped; an integer on the wire, a word in the API."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # cancelled by the client or the server
    ERROR = 3  # the engine failed while serving it

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0  # which API server sent it
    data_parallel_rank: int | None = None
    current_wave: int = 0  # the DP wave the API server saw (MoE lockstep; dense engines ignore it)
    # Structured outputs: the llguidance grammar the output must match (None: free), and
    # the token ids after which it starts to apply (the end of a reasoning section).
    grammar: str | None = None
    grammar_after: list[int] = []
    # Seconds the request may wait, from its arrival in the engine core, before its first
    # step; past that, if still waiting, it ends with ABORT and stop reason QUEUE_TIMEOUT.
    max_queue_time: float | None = None


#: The stop reason of a request that waited past its ``max_queue_time`` (finish reason ABORT).
QUEUE_TIMEOUT = "max_queue_time"
#: The stop reason of a request refused because the engine is asleep (finish reason ERROR).
SLEEPING = "sleeping"


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs at one position: the chosen (or actual) token first, then the top-n.

    ``ranks[i]`` is the 1-based rank of ``token_ids[i]`` in the distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Progress of one request in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt positions 1.. (position 0 has no logprob), in order, possibly in chunks.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival in the engine to first scheduling


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to one UTILITY call, matched to it by ``call_id``."""

    call_id: int
    result: Any = None
    error: str | None = None  # set when the call raised; result is then None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced for one client."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    # Sent to the coordinator only (client index -1), for lockstep (MoE) engines: the
    # wave this engine finished, or the wave a request asked this paused engine to start.
    wave_complete: int | None = None
    start_wave: int | None = None
