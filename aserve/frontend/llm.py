"""``LLM``: offline batch generation, named and shaped as vLLM's.

    from aserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-model")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

``generate`` validates every prompt and parameter before queuing any, so a bad input
raises a typed ``InvalidInputError`` and the object stays usable; an exception while
stepping aborts that call's requests before it propagates.

At ``tensor_parallel_size`` 1 the model runs in the caller's process. Above it, one
worker process per rank runs it (as in the server); ``shutdown()`` (or leaving a
``with LLM(...)`` block, or garbage collection) stops them and removes their shared
memory. Scripts that use TP > 1 need the ``if __name__ == "__main__":`` guard, since
workers are started with ``spawn``.
"""

from __future__ import annotations

import itertools
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_PREFIX_CACHE_RESERVE, EngineConfig
from aserve.engine.engine_core import EngineCore, fit_config
from aserve.errors import InvalidInputError
from aserve.executor.multiproc import MultiprocExecutor
from aserve.frontend.engine_args import make_engine_config
from aserve.frontend.input_processor import InputProcessor, PromptType
from aserve.frontend.output_processor import OutputProcessor, RequestState, child_params, child_request_id
from aserve.launch.process_utils import cleanup_instance
from aserve.outputs import RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.tokenizer import Tokenizer


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory: int = DEFAULT_CPU_KV_CACHE_MEMORY,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefix_cache_reserve: float = DEFAULT_PREFIX_CACHE_RESERVE,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        tensor_parallel_size: int = 1,
        tp_comm: str = "auto",
        kv_cache_dtype: str = "auto",
        device: str = "auto",
    ) -> None:
        config = make_engine_config(
            model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_model_len=max_model_len, seed=seed,
            kv_cache_memory=kv_cache_memory, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            prefix_cache_reserve=prefix_cache_reserve, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, long_prefill_token_threshold=long_prefill_token_threshold,
            tp_comm=tp_comm, kv_cache_dtype=kv_cache_dtype, device=device,
        )
        fitted = fit_config(config)
        self.tokenizer = Tokenizer(Path(config.model.model))
        self._instance: tuple[str, str] | None = None
        if tensor_parallel_size == 1:
            # Imported here: it brings torch and the model into this process, which
            # ``import aserve`` alone (the server's front end) must not.
            from aserve.executor.in_process import InProcessExecutor

            executor_factory = InProcessExecutor
        else:
            # Workers in their own processes, over the same rings as the server; this
            # object owns their shared memory and IPC files.
            instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
            instance_dir = tempfile.mkdtemp(prefix=f"{instance_id}-")
            self._instance = (instance_id, instance_dir)
            self._finalizer = weakref.finalize(self, _shutdown, None, instance_id, instance_dir)

            def executor_factory(cfg: EngineConfig) -> MultiprocExecutor:
                return MultiprocExecutor(cfg, instance_dir=instance_dir, instance_id=instance_id)
        try:
            self.engine = EngineCore(fitted, executor_factory)
        except BaseException:
            self.shutdown()
            raise
        if self._instance is not None:
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self.engine, *self._instance)
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
        for params in params_list:
            self.input_processor.check_params(params)
        tokenized = [self.input_processor.tokenize(p) for p in prompt_list]
        return self._run(tokenized, params_list)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt)
            # The template already holds any BOS the model wants.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

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

    def _run(self, tokenized: list[tuple[str | None, list[int]]], params_list: list[SamplingParams]) -> list[RequestOutput]:
        processor = OutputProcessor()
        order: list[str] = []
        engine_ids: list[str] = []
        for (text, ids), params in zip(tokenized, params_list):
            request_id = str(next(self._ids))
            params = params if params.output_kind == RequestOutputKind.FINAL_ONLY else _final_only(params)
            processor.add(RequestState(request_id, text, ids, params, self.tokenizer))
            order.append(request_id)
            for i in range(params.n):
                child_id = child_request_id(request_id, i, params.n)
                self.engine.add_request(self.input_processor.make_request(child_id, ids, child_params(params, i)))
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


def _shutdown(engine: EngineCore | None, instance_id: str, instance_dir: str) -> None:
    if engine is not None:
        engine.shutdown()
    cleanup_instance(instance_id, instance_dir)


def _final_only(params: SamplingParams) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
