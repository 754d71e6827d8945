"""What the scheduler tells the model runner each step: only what changed.

The runner keeps each request's tokens and block table between steps; a step names the
requests that are new to it (in full), the ones it already knows (new blocks only), how
many tokens of each to compute, and the ones to forget (finished, aborted, preempted).
A preempted request comes back later as new, with every token it has so far.
"""

from __future__ import annotations

import msgspec

from aserve.sampling_params import SamplingParams


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


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    freed_req_ids: list[str] = []  # forget these before running this step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
