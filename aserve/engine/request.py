"""The engine's view of one request: its tokens, its progress and its status.

::

    WAITING ──schedule──► RUNNING ──eos/stop/length/abort──► FINISHED
       ▲                     │
       └──────preempt────────┘   (KV blocks freed; recomputed from token 0 later)
"""

from __future__ import annotations

import enum
import hashlib
import time
from array import array

from aserve.errors import PromptTooLongError
from aserve.sampling_params import SamplingParams
from aserve.wire.messages import EngineCoreRequest, FinishReason


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The rule every path applies (``InputProcessor`` in the front end, the engine core
    for requests that reach it directly): the prompt must leave room for one token, and
    the prompt plus ``max_tokens`` (when set) must fit ``max_model_len``. Raises
    ``PromptTooLongError`` naming ``prompt`` or ``max_tokens``."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}, which must leave room "
            "for at least one generated token; shorten the prompt or raise max_model_len", param="prompt")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.", param="max_tokens")


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, after losing its blocks
    FINISHED = 3


class Request:
    __slots__ = (
        "request_id", "sampling_params", "eos_token_ids", "stop_token_ids", "arrival_time", "priority",
        "cache_salt", "client_index", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
        "status", "block_hashes", "num_cached_tokens", "max_tokens", "finish_reason", "stop_reason",
        "num_preemptions", "num_prompt_logprobs_sent", "_salt_bytes", "received_time", "queue_time", "num_inflight",
        "grammar", "grammar_after", "queue_deadline",
    )

    def __init__(self, req: EngineCoreRequest, *, max_model_len: int) -> None:
        sp = req.sampling_params
        self.request_id = req.request_id
        self.sampling_params: SamplingParams = sp
        self.eos_token_ids = frozenset(req.eos_token_ids)
        self.stop_token_ids = frozenset(sp.stop_token_ids or ())
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.client_index = req.client_index
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        # Tokens the scheduler has handed to the model runner, sampled or not yet returned
        # included: with asynchronous scheduling the next step is scheduled while this
        # one runs, so both run ahead of ``all_token_ids``.
        self.num_computed_tokens = 0
        self.num_inflight = 0  # tokens being sampled by steps whose output has not come back
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # set when first scheduled
        # None: up to max_model_len. A request whose max_tokens cannot fit is refused before
        # it gets here (``EngineCore.prepare_request``), never cut short in silence.
        self.max_tokens = max_model_len - self.num_prompt_tokens if sp.max_tokens is None else sp.max_tokens
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0
        self.received_time = time.monotonic()  # the engine's clock: queue time is measured there
        self.queue_time: float | None = None  # set when first scheduled; sent once
        # The engine-clock time after which, never scheduled, it is expired (max_queue_time).
        self.queue_deadline = None if req.max_queue_time is None else self.received_time + req.max_queue_time
        self._salt_bytes = (req.cache_salt or "").encode()
        self.grammar = req.grammar
        self.grammar_after = req.grammar_after

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every newly completed block of tokens (for prefix caching).

        A block's hash covers its parent's hash, its token ids and the cache salt, so
        equal hashes mean equal prefixes; blake2b keeps collisions out of reach.
        """
        hashes = self.block_hashes
        tokens = self.all_token_ids
        while (len(hashes) + 1) * block_size <= len(tokens):
            start = len(hashes) * block_size
            h = hashlib.blake2b(digest_size=16)
            h.update(hashes[-1] if hashes else self._salt_bytes)
            h.update(array("q", tokens[start : start + block_size]).tobytes())
            hashes.append(h.digest())
