"""Iteration-level (continuous) batching over a paged KV cache. Logic only: no I/O.

Each :meth:`Scheduler.schedule` call fills one step under a token budget
(``max_num_batched_tokens``) and a request cap (``max_num_seqs``):

1. running requests first, in order, each getting the tokens it still lacks (one for
   a decoding request, a chunk for a prompt still being prefilled); when the pool is
   short, the lowest-priority, latest running request is preempted (its blocks freed;
   it is recomputed later), repeatedly, until the allocation fits;
2. then waiting requests by (priority, arrival), each starting from its longest cached
   prefix, while the budget, the cap and the pool allow. Prompts that do not fit the
   remaining budget are prefilled in chunks, except in a step that holds the last
   chunk of a prompt split earlier: there a new prompt starts only if it fits whole.
   Why: a long prompt's short tail would otherwise wait for the next prompt's large
   first chunk (2,048-token prompts at a 2,048-token budget beside running decodes:
   each first token one whole prefill later than it need be).

:meth:`Scheduler.update_from_output` appends the sampled tokens and finishes requests
on EOS, a stop token or their length limit.

Scheduling may run one step ahead of the model (asynchronous scheduling: the engine
schedules step N+1 while step N runs, so the worker never waits for the engine). A
request's ``num_computed_tokens`` therefore advances when a step is scheduled, and a
step that reaches the end of a request's tokens leaves a placeholder (``num_inflight``)
for the token it will sample: the next step schedules that token's successor, and the
model runner, which appends its own sampled tokens, already has its input. A request
that finishes on a token still in flight (EOS, a stop token) costs the step after it one
wasted row, whose output is dropped; a length limit is known ahead and wastes nothing.
A request preempted while a step of it is in flight has that token dropped and
recomputed later (sampling depends only on the seed and the position).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time


from aserve.config import SchedulerConfig
from aserve.engine.kv_cache_manager import KVCacheManager
from aserve.engine.request import Request, RequestStatus
from aserve.wire.messages import QUEUE_TIMEOUT, EngineCoreOutput, FinishReason
from aserve.wire.worker_messages import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, max_model_len: int,
                 pipeline_batches: int = 1) -> None:
        """``pipeline_batches`` P > 1 (pipeline stages, P batches in flight): a request
        whose sampled token is still in flight is not scheduled again until it comes
        back, and a batch takes at most 1/P of the running requests, so the batches in
        flight hold different requests and every stage has one to work on (vLLM's batch
        queue). Each scheduled request's tokens travel with the step
        (``new_token_ids``), for the stages that do not sample."""
        self.pipeline_batches = pipeline_batches
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[tuple[int, float, int], Request]] = []  # sorted by key
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._freed_since_last_step: list[str] = []
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0
        # (deadline, arrival, request) of waiting requests with a max_queue_time: a heap,
        # so a step finds the expired ones without looking at the others.
        self._queue_deadlines: list[tuple[float, int, Request]] = []

    # -- queue management -------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.update_block_hashes(self.block_size)  # a no-op when already prepared
        self.requests[request.request_id] = request
        self._enqueue(request)
        if request.queue_deadline is not None:
            heapq.heappush(self._queue_deadlines, (request.queue_deadline, next(self._arrivals), request))

    def expire_queued(self, now: float) -> list[EngineCoreOutput]:
        """Finish (ABORT, stop reason ``QUEUE_TIMEOUT``) the requests still waiting for
        their first step past their ``max_queue_time``; preempted requests, which have
        had theirs, are not expired."""
        outputs = []
        heap = self._queue_deadlines
        while heap and heap[0][0] <= now:
            _, _, request = heapq.heappop(heap)
            if request.status != RequestStatus.WAITING or request.num_cached_tokens >= 0:
                continue  # scheduled meanwhile, or finished
            self.waiting = [item for item in self.waiting if item[1] is not request]
            self._finish(request, FinishReason.ABORT, QUEUE_TIMEOUT)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT,
                                            stop_reason=QUEUE_TIMEOUT))
        return outputs

    def _enqueue(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._arrivals))
        bisect.insort(self.waiting, (key, request), key=lambda item: item[0])

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish the named requests (unknown or finished ids are ignored)."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting = [item for item in self.waiting if item[1] is not request]
            self._finish(request, FinishReason.ABORT)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT))
        return outputs

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        self._forget(request)

    def _forget(self, request: Request) -> None:
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._freed_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight = 0  # dropped when its step's output comes back
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget(request)
        self._enqueue(request)

    def _victim(self, first_unscheduled: int) -> Request:
        # Lowest priority (largest number), then latest arrival, among the running
        # requests this step has not scheduled yet (the current one included).
        return max(self.running[first_unscheduled:], key=lambda r: (r.priority, r.arrival_time))

    # -- one step ---------------------------------------------------------------

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_inflight and self.pipeline_batches > 1:
            return 0  # its token is in a batch still in flight: the next batch holds others
        if request.num_inflight and (
            request.num_output_tokens + request.num_inflight >= request.max_tokens
            or request.num_tokens + request.num_inflight >= self.max_model_len
        ):
            return 0  # the token in flight is its last: nothing more to compute
        n = min(request.num_tokens + request.num_inflight - request.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            n = min(n, threshold)
        return n

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        # With pipeline batches, a share of the running requests: the rest go in the
        # batches the other stages will run.
        quota = -(-len(self.running) // self.pipeline_batches)
        # Whether a prompt whose prefill was split over steps gets its last chunk in this
        # one: then no new prompt starts a partial chunk here (see the waiting loop).
        completes_split_prompt = False
        i = 0
        while i < len(self.running) and budget > 0 and len(cached_reqs) < quota:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                new_block_ids = self.kv.allocate(request, n)
                if new_block_ids is not None:
                    break
                victim = self._victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # the request preempted itself; `i` now points at the next one
            num_scheduled[request.request_id] = n
            budget -= n
            start = request.num_computed_tokens
            if n > 1 and start + n >= request.num_tokens:
                completes_split_prompt = True
            cached_reqs.append(CachedRequestData(
                request.request_id, new_block_ids, start,
                list(request.all_token_ids[start : start + n]) if self.pipeline_batches > 1 else []))
            self._advance(request, n)
            i += 1

        # A step that had to preempt is short of blocks: admit nobody new.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            _, request = self.waiting[0]
            cached_blocks = []
            if request.num_computed_tokens == 0:
                cached_blocks = self.kv.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.block_size
            n = min(request.num_tokens - num_cached, budget)
            if n < request.num_tokens - num_cached and (completes_split_prompt or not self.config.enable_chunked_prefill):
                # A split prompt's last chunk would otherwise share its step with this
                # prompt's first, large one, and its first token would wait for that
                # chunk too: this prompt starts one (short) step later instead.
                break
            threshold = self.config.long_prefill_token_threshold
            if threshold is not None:
                n = min(n, threshold)
            new_block_ids = self.kv.allocate(request, n, cached_blocks)
            if new_block_ids is None:
                break
            self.waiting.pop(0)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.queue_time = time.monotonic() - request.received_time
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._known_to_runner.add(request.request_id)
            num_scheduled[request.request_id] = n
            budget -= n
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.block_ids(request.request_id),
                    num_computed_tokens=num_cached,
                    stop_token_ids=sorted(self._stop_ids(request)),
                )
            )
            self._advance(request, n)

        freed, self._freed_since_last_step = self._freed_since_last_step, []
        return SchedulerOutput(
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            freed_req_ids=freed,
        )

    @staticmethod
    def _advance(request: Request, n: int) -> None:
        """Count ``n`` scheduled tokens as computed; a step that reaches the end of the
        request's tokens samples one more, in flight until its output comes back."""
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens + request.num_inflight:
            request.num_inflight += 1

    @staticmethod
    def _stop_ids(request: Request) -> frozenset[int]:
        eos = frozenset() if request.sampling_params.ignore_eos else request.eos_token_ids
        return eos | request.stop_token_ids

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[EngineCoreOutput]:
        """Append the step's sampled tokens; finish the done ones.

        Outputs of requests that finished, or were aborted or preempted, after the step
        was scheduled are dropped."""
        prompt_lps = {}
        if out.prompt_logprobs:
            starts = {r.req_id: r.num_computed_tokens for r in sched.new_requests}
            starts.update((r.req_id, r.num_computed_tokens) for r in sched.cached_requests)
            for request_id, lps in out.prompt_logprobs.items():
                request = self.requests.get(request_id)
                if request is not None and request.status == RequestStatus.RUNNING:
                    # A request recomputed after preemption must not report positions
                    # twice: this chunk covers prompt positions start + 1 onwards.
                    skip = max(0, request.num_prompt_logprobs_sent - starts[request_id])
                    if lps[skip:]:
                        prompt_lps[request_id] = lps[skip:]
                        request.num_prompt_logprobs_sent += len(lps) - skip
        outputs: list[EngineCoreOutput] = []
        sampled = dict(zip(out.req_ids, out.sampled_token_ids))
        for request_id, lps in prompt_lps.items():
            if request_id not in sampled:
                outputs.append(EngineCoreOutput(request_id, [], new_prompt_logprobs=lps))
        for request_id, token in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted after the step was scheduled
            request.num_inflight -= 1
            request.all_token_ids.append(token)
            request.update_block_hashes(self.block_size)
            finish, stop_reason = self._check_stop(request, token)
            queue_time, request.queue_time = request.queue_time, None  # reported with the first token
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [token],
                    new_logprobs=[out.logprobs[request_id]] if request_id in out.logprobs else None,
                    new_prompt_logprobs=prompt_lps.get(request_id),
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    queue_time=queue_time,
                )
            )
            if finish is not None:
                self.running.remove(request)
                self._finish(request, finish, stop_reason)
        return outputs

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        sp = request.sampling_params
        if request.num_output_tokens > sp.min_tokens:  # stop ids were masked until then
            if token in request.stop_token_ids:
                return FinishReason.STOP, token
            if not sp.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
