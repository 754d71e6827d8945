"""Messages on wire 2: the engine core's shared-memory rings to and from its workers.

Each step the engine writes one ``WorkerCall`` to the broadcast ring that every worker
of its TP group reads; the call's output rank answers with one ``WorkerReply`` on its
own response ring. A call names one method from a fixed set (``WorkerMethod``), never
an arbitrary attribute, and nothing is pickled: msgpack, typed decoders.

The step itself (``SchedulerOutput``) carries only what changed: the model runner keeps
each request's tokens and block table between steps; a step names the requests that
are new to it (in full), the ones it already knows (new blocks only), how many tokens of
each to compute, and the ones to forget (finished, aborted, preempted). A preempted
request comes back later as new, with every token it has so far. The answer
(``RunnerOutput``) holds the sampled token of each request that sampled, and the
logprobs asked for.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from aserve.sampling_params import SamplingParams
from aserve.wire.messages import TokenLogprobs


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    token_ids: list[int]  # prompt, then any output tokens (a resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: list[int] = []  # EOS and stop token ids, masked before min_tokens


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # With pipeline stages: the tokens this step computes for the request. Only the last
    # stage samples, so the stages before it learn the sampled tokens here.
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    freed_req_ids: list[str] = []  # forget these before running this step
    # Structured outputs: a request of this step has a grammar, so a ``grammar_masks``
    # call follows on the ring, written once the tokens before this step are known;
    # every rank that samples reads it before it samples (aserve.engine.grammar).
    masks_follow: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class RunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The model runner's answer to one ``SchedulerOutput``."""

    req_ids: list[str]  # requests that sampled a token this step
    sampled_token_ids: list[int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs]]


class GrammarMasks(msgspec.Struct, array_like=True, gc=False):
    """The token masks of one step's rows under a started grammar: ``bits`` is int32
    [len(req_ids), words], little-endian, bit ``t % 32`` of word ``t // 32`` set where token ``t`` may come next.
    A row of the step not named here samples freely."""

    req_ids: list[str]
    words: int
    bits: bytes


WorkerMethod = Literal["execute_model", "grammar_masks", "shutdown", "sleep", "wake_up", "start_profile",
                       "stop_profile"]


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    method: WorkerMethod
    sched: SchedulerOutput | None = None
    output_rank: int = 0  # the one rank that replies
    arg: int | str | None = None  # sleep's level, start_profile's directory
    masks: GrammarMasks | None = None  # grammar_masks: those of the step in flight that asked


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ok: bool
    output: RunnerOutput | None = None
    error: str | None = None
    result: str | None = None  # what a call other than execute_model returned (stop_profile's path)


CALL_DECODER = msgspec.msgpack.Decoder(WorkerCall)
REPLY_DECODER = msgspec.msgpack.Decoder(WorkerReply)
