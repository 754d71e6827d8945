"""``AsyncLLM``: the engine in its own processes, driven from asyncio or Trio.

::

    async with AsyncLLM(model=PATH, tensor_parallel_size=2) as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

``AsyncLLM(model, **kwargs)`` takes exactly ``EngineArgs``' fields. Entering the block
starts ``data_parallel_size`` engine-core processes (each starts one worker process per
TP rank; with more than one, a DP coordinator process too) and waits until every engine
reports READY; leaving it, by any path, stops them and removes their shared memory and
IPC files. With several engines, each request goes to the engine with the lowest load
score (``aserve.frontend.load_balancer``). The processes, sockets and health watching
are the ``EngineCoreClient``'s (``self.engine_core``); this class is the request API.

Contracts:

- Cancelling the task that iterates ``generate`` (or closing the iterator) aborts the
  request in the engine: its KV blocks are free again after the next step.
- If any engine process dies, every request in flight raises ``EngineDeadError``
  within seconds, new requests raise it at once, and ``check_health()`` raises it.
- Bad input raises ``InvalidInputError`` before anything reaches the engine.

The HTTP layer uses the narrow interface ``aserve.frontend.engine_client.EngineClient``
that this class implements: :meth:`prepare` (and :meth:`render_chat`) validate and
tokenise once, and :meth:`generate` sends what they return as it is.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from aserve.engine.args import EngineArgs
from aserve.engine.fit import FittedConfig, fit_config
from aserve.errors import ConfigError, EngineSleepingError, InvalidInputError, RequestTimeoutError
from aserve.frontend.core_client import EngineAttachment, EngineCoreClient
from aserve.frontend.input_processor import InputProcessor, PreparedPrompt, PromptType
from aserve.frontend.output_processor import OutputProcessor, RequestState, child_params, child_request_id
from aserve.frontend.tokenizer import Tokenizer
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams, is_int64
from aserve.wire.codec import EngineReady
from aserve.wire.messages import QUEUE_TIMEOUT, SLEEPING, EngineCoreOutput


class _Wakeup:
    """A level-triggered flag one task waits on and any code in the same event loop sets;
    ``set`` never blocks and repeated sets before a wait count once.

    Every streamed request waits on one once per engine step. Under asyncio the waiter
    is a bare future of the running loop (1.3 us a wait-and-wake on uvloop, against 3.7
    for a fresh ``anyio.Event``, which wraps an ``asyncio.Event`` that takes a global
    lock on its first wait); under Trio it is an ``anyio.Event``."""

    __slots__ = ("_flag", "_waiter")

    def __init__(self) -> None:
        self._flag = False
        self._waiter: asyncio.Future[None] | anyio.Event | None = None

    def set(self) -> None:
        self._flag = True
        waiter = self._waiter
        if waiter is None:
            return
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(None)
        else:
            waiter.set()

    async def wait(self) -> None:
        """Return once the flag is set (at once if it already is), clearing it."""
        if not self._flag:
            loop = asyncio._get_running_loop()  # None under Trio
            try:
                if loop is not None:
                    future = self._waiter = loop.create_future()
                    await future
                else:
                    event = self._waiter = anyio.Event()
                    await event.wait()
            finally:
                self._waiter = None
        self._flag = False


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: ``EngineArgs``' fields; an unknown one is a ``TypeError`` naming the
        closest. Bad directories and settings raise here, in the caller."""
        self.engine_args = EngineArgs.from_kwargs("AsyncLLM", model, kwargs)
        if self.engine_args.nnodes > 1:
            raise ConfigError("an engine across machines (nnodes > 1) is served by `aserve run` on each node "
                              "(docs/parallelism.md)", param="nnodes")
        self._setup(fit_config(self.engine_args.create_engine_config("library")), None)

    @classmethod
    def attached(cls, fitted: FittedConfig, attach: EngineAttachment) -> AsyncLLM:
        """An ``AsyncLLM`` over engines the ``aserve run`` supervisor started and owns (the
        API server's), with the config the supervisor fitted."""
        self = cls.__new__(cls)
        self.engine_args = None
        self._setup(fitted, attach)
        return self

    def _setup(self, fitted: FittedConfig, attach: EngineAttachment | None) -> None:
        self.fitted = fitted
        self.config = fitted.config
        self.tokenizer = Tokenizer(Path(self.config.model.model))
        self.input_processor = InputProcessor.for_model(fitted, self.tokenizer)
        self.engine_core = EngineCoreClient(fitted, on_outputs=self._on_outputs, on_dead=self._on_dead, attach=attach)
        self.num_engines = self.engine_core.num_engines
        self._processor = OutputProcessor()
        self._streams: dict[str, _Wakeup] = {}  # request id -> its generate iterator's wake-up
        self._engine_of: dict[str, int] = {}  # request id -> DP rank serving it

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLM:
        await self.engine_core.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.engine_core.__aexit__(*exc_info)

    def _on_outputs(self, engine: int, outputs: list[EngineCoreOutput]) -> None:
        # Only applies the outputs and wakes the iterators; each RequestOutput is made
        # in ``generate``, when its consumer is ready for it.
        touched, to_abort = self._processor.apply(outputs)
        if to_abort:
            self.engine_core.abort(to_abort, engine)
        for state in touched:
            wakeup = self._streams.get(state.request_id)
            if wakeup is not None:
                wakeup.set()

    def _on_dead(self) -> None:
        for wakeup in list(self._streams.values()):
            wakeup.set()

    # -- the interface the HTTP layer uses (aserve.frontend.engine_client) ------------

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    @property
    def is_dead(self) -> bool:
        return self.engine_core.dead is not None

    @property
    def ready(self) -> EngineReady | None:
        """Engine 0's READY once every engine has sent its own; None until then."""
        return self.engine_core.ready

    @property
    def dead_event(self) -> anyio.Event:
        return self.engine_core.dead_event

    @property
    def failure(self) -> Exception | None:
        """Why an engine died, unless this ``AsyncLLM`` stopped them."""
        return self.engine_core.failure

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def prepare(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
                grammar_after: tuple[int, ...] = (), constraint_param: str = "structured_outputs") -> PreparedPrompt:
        """Validate, compile the structured-output constraint and tokenise, once
        (``InputProcessor.prepare``); raises ``InvalidInputError`` subclasses and sends
        nothing."""
        return self.input_processor.prepare(prompt, sampling_params or SamplingParams(), grammar_after=grammar_after,
                                            constraint_param=constraint_param)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A conversation through the model's chat template, as a prompt for :meth:`prepare`."""
        return self.input_processor.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                template_kwargs=template_kwargs)

    def engine_for(self, request_id: str) -> int | None:
        """The DP rank of the engine serving a request in progress."""
        return self._engine_of.get(request_id)

    async def generate(
        self,
        prompt: PromptType | PreparedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        max_queue_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative, delta or final-only per
        ``sampling_params.output_kind``) until it finishes.

        ``prompt`` is a prompt (checked here) or what :meth:`prepare` returned (sent as
        it is; ``sampling_params`` must then be None). With several engines, the load
        balancer picks one (``data_parallel_rank`` pins it); every ``n`` child of the
        request goes to the same engine, so they share the prompt's cached blocks.
        ``max_queue_time``: seconds the request may wait for its first engine step;
        past them it is aborted and ``RequestTimeoutError`` raised.
        Raises ``InvalidInputError`` for bad input (nothing is sent), ``EngineDeadError``
        if an engine dies. Cancellation or closing the iterator aborts the request.
        """
        core = self.engine_core
        core.check_alive()
        if not is_int64(priority):
            raise InvalidInputError(f"priority must be an integer in [-2**63, 2**63 - 1], got {priority!r}",
                                    param="priority")
        if isinstance(prompt, PreparedPrompt):
            if sampling_params is not None:
                raise InvalidInputError("a prepared prompt carries its sampling params: pass None",
                                        param="sampling_params")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, sampling_params)
        params, ids = prepared.params, prepared.token_ids
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidInputError(f"request id {request_id!r} is already in use", param="request_id")
        state = RequestState(request_id, prepared.text, ids, params, self.tokenizer)
        engine = core.load_balancer.pick(data_parallel_rank)  # counted in flight from here: released in finally
        wakeup = _Wakeup()
        self._streams[request_id] = wakeup
        self._engine_of[request_id] = engine
        self._processor.add(state)
        finished = False
        try:
            for i in range(params.n):
                core.add(self.input_processor.make_request(
                    child_request_id(request_id, i, params.n), ids, child_params(params, i), priority=priority,
                    grammar=prepared.grammar, grammar_after=prepared.grammar_after, max_queue_time=max_queue_time),
                    engine)
            # A consumer that fell behind (a slow client, a busy API server) gets one
            # delta covering every step it missed rather than one per step, as vLLM's
            # output collector merges them.
            while True:
                await wakeup.wait()
                if core.dead is not None and not state.finished:
                    raise core.dead
                output = state.make_output()
                if output is None:
                    continue
                if any(c.stop_reason == SLEEPING and c.finish_reason == "error" for c in output.outputs):
                    raise EngineSleepingError("the engine is asleep: wake it up (wake_up(), POST /wake_up) first")
                if any(c.stop_reason == QUEUE_TIMEOUT and c.finish_reason == "abort" for c in output.outputs):
                    raise RequestTimeoutError(f"the request waited more than max_queue_time={max_queue_time} s for "
                                              "its first step and was aborted", param="max_queue_time")
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._engine_of.pop(request_id, None)
            core.load_balancer.finished(engine)
            if not finished:
                abandoned = self._processor.remove(request_id)
                if abandoned is not None:
                    core.abort(abandoned.child_ids, engine)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` iterator ends with finish reason "abort"."""
        state = self._processor.remove(request_id)
        if state is None:
            return
        engine = self._engine_of.get(request_id)
        if engine is not None:
            self.engine_core.abort(state.child_ids, engine)
        state.finish_all("abort")
        wakeup = self._streams.get(request_id)
        if wakeup is not None:
            wakeup.set()

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if any engine is dead; return once every one answers."""
        self.engine_core.check_alive()
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("ping", engine=engine)

    async def reset_prefix_cache(self) -> None:
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("reset_prefix_cache", engine=engine)

    # -- sleep and profile (docs/engine.md, "Sleep and profile") ------------------------

    async def sleep(self, level: int = 1) -> None:
        """Every engine gives its KV pool's memory back (level 1), and its weights' too
        (level 2: reloaded on waking). Only with no request in flight (``AserveError``
        otherwise); a request sent while asleep raises ``EngineSleepingError``."""
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("sleep", level, engine=engine)

    async def wake_up(self) -> None:
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("wake_up", engine=engine)

    async def is_sleeping(self) -> bool:
        return any([await self.engine_core.call_utility("is_sleeping", engine=e) for e in range(self.num_engines)])

    async def start_profile(self, directory: str) -> None:
        """Every worker of every engine records a ``torch.profiler`` trace until
        :meth:`stop_profile`, which writes one file per worker into ``directory``."""
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("start_profile", str(directory), engine=engine)

    async def stop_profile(self) -> None:
        for engine in range(self.num_engines):
            await self.engine_core.call_utility("stop_profile", engine=engine)

    async def get_stats(self, engine: int = 0) -> dict[str, float]:
        """Engine ``engine``'s counts: running, waiting, KV usage, free blocks, and its
        totals of finished requests and tokens."""
        return await self.engine_core.call_utility("get_stats", engine=engine)
