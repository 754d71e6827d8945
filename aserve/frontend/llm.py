"""``LLM``: offline batch generation, named and shaped as vLLM's.

    from aserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-model")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

``generate`` validates every prompt and parameter before queuing any, so a bad input
raises a typed ``InvalidInputError`` and the object stays usable; an exception while
stepping aborts that call's requests before it propagates.

``LLM(model, **kwargs)`` takes exactly ``EngineArgs``' fields (one engine:
``data_parallel_size`` must be 1). At ``tensor_parallel_size`` 1 the model runs in the
caller's process (``worker_threads``, when given, sets its torch threads). Above it, one
worker process per rank runs it (as in the server; a worker that exits or stops ticking
its heartbeat fails the step); ``shutdown()`` (or leaving a
``with LLM(...)`` block, or garbage collection) stops them and removes their shared
memory. Scripts that use TP > 1 need the ``if __name__ == "__main__":`` guard, since
workers are started with ``spawn``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aserve.config import EngineConfig
from aserve.engine.args import EngineArgs
from aserve.engine.engine_core import EngineCore
from aserve.engine.fit import fit_config
from aserve.engine.spawn import create_heartbeats
from aserve.errors import ConfigError, EngineSleepingError, InvalidInputError
from aserve.executor.multiproc import MultiprocExecutor
from aserve.frontend.input_processor import InputProcessor, PromptType
from aserve.frontend.output_processor import OutputProcessor, RequestState, child_params, child_request_id
from aserve.frontend.tokenizer import Tokenizer
from aserve.outputs import RequestOutput
from aserve.process.instance import Instance
from aserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: ``EngineArgs``' fields; an unknown one is a ``TypeError`` naming the
        closest. Raises ``ConfigError`` and the model-loading errors here."""
        self.engine_args = EngineArgs.from_kwargs("LLM", model, kwargs)
        if self.engine_args.data_parallel_size != 1:
            raise ConfigError("LLM runs one engine: data_parallel_size must be 1 (AsyncLLM and aserve run serve "
                              "several)", param="data_parallel_size")
        if self.engine_args.nnodes > 1:
            raise ConfigError("an engine across machines (nnodes > 1) is served by `aserve run` on each node "
                              "(docs/parallelism.md)", param="nnodes")
        fitted = fit_config(self.engine_args.create_engine_config("library"))
        config = fitted.config
        self.tokenizer = Tokenizer(Path(config.model.model))
        self._instance: Instance | None = None
        if config.parallel.world_size == 1:
            # Imported here: it brings torch and the model into this process, which
            # ``import aserve`` alone (the server's front end) must not.
            from aserve.executor.in_process import InProcessExecutor

            executor_factory = InProcessExecutor
        else:
            # Workers in their own processes, over the same rings as the server; this
            # object owns their shared memory and IPC files.
            instance = self._instance = Instance.create()
            self._finalizer = weakref.finalize(self, _shutdown, None, instance)
            heartbeats = create_heartbeats(instance, config.parallel.world_size, range(1))

            def executor_factory(cfg: EngineConfig) -> MultiprocExecutor:
                return MultiprocExecutor(cfg, instance=instance, heartbeat_name=heartbeats)
        try:
            self.engine = EngineCore(fitted, executor_factory)
        except BaseException:
            self.shutdown()
            raise
        if self._instance is not None:
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self.engine, self._instance)
        self.config = self.engine.config
        self.input_processor = InputProcessor.for_model(fitted, self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop worker processes and remove their shared memory (TP > 1); idempotent.
        Also runs when the object is garbage-collected or the interpreter exits."""
        if self._instance is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one finished ``RequestOutput`` per prompt, in order."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidInputError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; give one, or one per prompt"
                )
        prepared = [self.input_processor.prepare(p, params) for p, params in zip(prompt_list, params_list)]
        return self._run(prepared)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            self.input_processor.render_chat(list(conversation), add_generation_prompt=add_generation_prompt)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    # -- sleep and profile (docs/engine.md, "Sleep and profile") ------------------------

    def sleep(self, level: int = 1) -> None:
        """Give the KV pool's memory back (level 1), and the weights' too (level 2,
        reloaded by :meth:`wake_up`); ``generate`` raises ``EngineSleepingError`` until then."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def start_profile(self, directory: str) -> None:
        """Record a ``torch.profiler`` trace of every worker until :meth:`stop_profile`,
        which writes one file per worker into ``directory``."""
        self.engine.start_profile(str(directory))

    def stop_profile(self) -> None:
        self.engine.stop_profile()

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt as token ids
        if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
            if not prompts:
                raise InvalidInputError("no prompts given", param="prompt")
            return list(prompts)
        raise InvalidInputError(f"prompts must be a string, token ids or a list of those, not {type(prompts).__name__}")

    def _run(self, prepared: list[Any]) -> list[RequestOutput]:
        if self.engine.sleeping:
            raise EngineSleepingError("the engine is asleep: call wake_up() first")
        processor = OutputProcessor()
        order: list[str] = []
        engine_ids: list[str] = []
        for item in prepared:
            text, ids, params = item.text, item.token_ids, item.params
            request_id = str(next(self._ids))
            params = params if params.output_kind == RequestOutputKind.FINAL_ONLY else _final_only(params)
            processor.add(RequestState(request_id, text, ids, params, self.tokenizer))
            order.append(request_id)
            for i in range(params.n):
                child_id = child_request_id(request_id, i, params.n)
                self.engine.add_request(self.input_processor.make_request(
                    child_id, ids, child_params(params, i), grammar=item.grammar, grammar_after=item.grammar_after))
                engine_ids.append(child_id)
        results: dict[str, RequestOutput] = {}
        try:
            while processor.requests:
                outputs, to_abort = processor.process(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for output in outputs:
                    results[output.request_id] = output
        finally:
            if processor.requests:  # interrupted: leave the engine clean for the next call
                self.engine.abort_requests(engine_ids)
        return [results[request_id] for request_id in order]


def _shutdown(engine: EngineCore | None, instance: Instance) -> None:
    if engine is not None:
        engine.shutdown()
    instance.cleanup()


def _final_only(params: SamplingParams) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
