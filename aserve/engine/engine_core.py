"""The engine core's logic: a scheduler, a KV cache manager and an executor, stepped.

No sockets, no event loop: ``add_request``, ``abort_requests`` and ``step`` are plain
calls, so the offline ``LLM`` drives this object directly and the engine-core process
wraps it with its wires.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from aserve.config import EngineConfig
from aserve.engine.fit import FittedConfig
from aserve.engine.grammar import GrammarState
from aserve.engine.kv_cache_manager import KVCacheManager
from aserve.engine.request import Request, check_fits
from aserve.engine.scheduler import Scheduler
from aserve.errors import AserveError, InvalidInputError
from aserve.wire.messages import EngineCoreOutput, EngineCoreRequest
from aserve.wire.worker_messages import GrammarMasks, SchedulerOutput


class EngineCore:
    def __init__(self, fitted: FittedConfig, executor_factory: Callable[[EngineConfig], object]) -> None:
        config = fitted.config
        self.config = config
        self.arch = fitted.arch
        self.kv_capacity_tokens = fitted.kv_capacity_tokens
        self.executor = executor_factory(config)
        assert config.cache.num_blocks is not None
        self.kv = KVCacheManager(
            config.cache.num_blocks, config.cache.block_size, enable_prefix_caching=config.cache.enable_prefix_caching,
            prefix_cache_reserve=config.cache.prefix_cache_reserve,
        )
        pp = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len=config.max_model_len,
                                   pipeline_batches=pp)
        # Steps handed to the executor whose output has not been read, oldest first. An
        # executor whose model runs elsewhere (worker processes) takes a second step while
        # the first runs: the engine schedules and processes outputs during the model step
        # instead of leaving the worker idle (asynchronous scheduling).
        # With pipeline stages, one batch per stage (of different requests: the scheduler's
        # pipeline_batches), so every stage has work.
        self.max_inflight = max(getattr(self.executor, "max_inflight", 1), pp)
        self._inflight: deque[SchedulerOutput] = deque()
        # Structured outputs' matchers (aserve.engine.grammar). A step with a constrained
        # request is followed by its masks once every step before it has been processed,
        # i.e. when it becomes the oldest in flight.
        self.grammars = GrammarState(Path(config.model.model), fitted.arch.vocab_size, fitted.arch.eos_token_ids)
        # Totals since start, for metrics: the engine's own count of what it served, the
        # same whichever API server asks.
        self.num_requests_received = 0
        self.num_requests_finished = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.sleeping = 0  # the level of the sleep the workers are in; 0: awake

    def prepare_request(self, request: EngineCoreRequest) -> Request:
        """Validate and build the scheduler's request (its prompt block hashes too).

        Separate from :meth:`add_prepared` so the engine-core process can do this work in
        its input task, overlapped with the model step in progress: it reads only the
        fitted config, never the scheduler's state. Raises ``PromptTooLongError`` when
        the prompt and its ``max_tokens`` do not fit ``max_model_len``.
        """
        check_fits(len(request.prompt_token_ids), request.sampling_params.max_tokens, self.config.max_model_len)
        prepared = Request(request, max_model_len=self.config.max_model_len)
        prepared.update_block_hashes(self.config.cache.block_size)
        return prepared

    def add_prepared(self, request: Request) -> None:
        if request.grammar is not None:
            self.grammars.add(request.request_id, request.grammar, request.grammar_after)
        self.scheduler.add_request(request)
        self.num_requests_received += 1
        self.num_prompt_tokens += request.num_prompt_tokens

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_prepared(self.prepare_request(request))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self._count(self.scheduler.abort_requests(request_ids))

    def _count(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Every output the engine gives passes here: counted, and fed to its matcher."""
        # None when no request is constrained (the usual case): one test a call, not one an output.
        grammars = self.grammars if len(self.grammars) else None
        for out in outputs:
            self.num_generation_tokens += len(out.new_token_ids)
            if grammars is not None and out.request_id in grammars:
                grammars.consume(out.request_id, out.new_token_ids)
                if out.finish_reason is not None:
                    grammars.remove(out.request_id)
            if out.finish_reason is not None:
                self.num_requests_finished += 1
        return outputs

    def _send_masks_of_oldest(self) -> None:
        """Send the masks of the oldest step in flight if it asked for them: every step
        before it has been processed, so its requests' matchers have every token the step
        continues from. Called exactly where a step becomes the oldest, so once a step:
        when it is submitted with none before it, and when the output of the one before
        it has been taken (the matchers just consumed its tokens and are in the cache).
        Either comes before the next step is scheduled, so on the ring the masks precede
        every step written after them."""
        if self._inflight and self._inflight[0].masks_follow:
            sched = self._inflight[0]
            ids, bits = self.grammars.masks(sched.num_scheduled_tokens)
            masks = GrammarMasks(ids, self.grammars.words, bits.tobytes())
            self.executor.submit_masks(masks)  # type: ignore[attr-defined]

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and take its output; then the next step's
        masks go at once, while the matchers that just took the tokens are in the cache."""
        sched = self._inflight.popleft()
        runner_output = self.executor.wait_model()  # type: ignore[attr-defined]
        outputs = self._count(self.scheduler.update_from_output(sched, runner_output))
        self._send_masks_of_oldest()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule a step, and return the progress of the oldest step in flight once
        ``max_inflight`` are (or nothing more can be scheduled).

        With ``max_inflight`` 1 this is: schedule, run the model, update. With 2, a call
        that leaves only one step in flight returns nothing at once, so the caller can
        take new input before the next call schedules the second step.
        """
        executor = self.executor
        # Requests that waited past their max_queue_time leave before the step is filled.
        expired = self._count(self.scheduler.expire_queued(time.monotonic()))
        if len(self._inflight) < self.max_inflight:
            sched = self.scheduler.schedule()
            if not sched.is_empty or sched.freed_req_ids:
                sched.masks_follow = self.grammars.any_of(sched.num_scheduled_tokens)
                executor.submit_model(sched)  # type: ignore[attr-defined]
                self._inflight.append(sched)
                if len(self._inflight) == 1:
                    self._send_masks_of_oldest()
                if len(self._inflight) < self.max_inflight:
                    return expired
        if not self._inflight:
            return expired
        return expired + self._finish_oldest()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    # -- sleep and profile (UTILITY calls; docs/engine.md, "Sleep and profile") ------------

    def sleep(self, level: int = 1) -> None:
        """Give the KV pool's memory back (level 1) and the weights' too (level 2, reloaded
        on waking). Only with no request in flight (``AserveError`` otherwise); requests
        that arrive while asleep are refused (``EngineSleepingError`` at the caller)."""
        if level not in (1, 2):
            raise InvalidInputError(f"sleep level must be 1 or 2, got {level}", param="level")
        if self.scheduler.has_unfinished_requests():
            raise AserveError("cannot sleep with requests in flight: let them finish, or abort them, first")
        if self.sleeping >= level:
            return
        while self._inflight:  # a last step that only told the workers which requests ended
            self._finish_oldest()
        self.scheduler.reset_prefix_cache()  # the pool's contents are gone
        self.executor.collective_rpc("sleep", level)  # type: ignore[attr-defined]
        self.sleeping = level

    def wake_up(self) -> None:
        if self.sleeping:
            self.executor.collective_rpc("wake_up")  # type: ignore[attr-defined]
            self.sleeping = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleeping)

    def start_profile(self, directory: str) -> None:
        """Every worker records a ``torch.profiler`` trace until :meth:`stop_profile`."""
        self.executor.collective_rpc("start_profile", directory)  # type: ignore[attr-defined]

    def stop_profile(self) -> str | None:
        """Write the traces (one file per worker, in the directory given); returns rank
        0's file."""
        return self.executor.collective_rpc("stop_profile")  # type: ignore[attr-defined]

    def ping(self) -> str:
        return "pong"

    def get_stats(self) -> dict[str, float]:
        """Counts for tests, health and metrics (a UTILITY call)."""
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage,
            "num_free_blocks": self.kv.pool.num_free_blocks,
            "num_usable_blocks": self.kv.pool.num_usable_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_received": self.num_requests_received,
            "num_requests_finished": self.num_requests_finished,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()  # type: ignore[attr-defined]
