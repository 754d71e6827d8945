"""``EngineClient``: everything the HTTP layer may use of the engine, and nothing more.

``AsyncLLM`` implements it; the API layer (``aserve.api``) is written against it, so it
never reaches into the sockets, the processes or the input processor, and a test can
stand a small fake in its place. A request goes through it as::

    prompt = engine.render_chat(messages)          # chat only: the template
    prepared = engine.prepare(prompt, params)      # validate and tokenise, once (4xx here)
    async for out in engine.generate(prepared, request_id=..., data_parallel_rank=...):
        ...                                        # deltas; EngineDeadError -> 503

Cancelling the task that iterates ``generate`` aborts the request in its engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio

from aserve.frontend.input_processor import PreparedPrompt, PromptType
from aserve.frontend.tokenizer import Tokenizer
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    #: How many DP engines serve requests (a pinned ``data_parallel_rank`` is below it).
    num_engines: int
    #: The model's tokenizer: chat templates, and the text of logprob tokens.
    tokenizer: Tokenizer

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def is_dead(self) -> bool:
        """True once any engine died (``/health`` is 503 from then on)."""

    @property
    def ready(self) -> Any:
        """Not None once every engine sent READY (``/ready`` may be 200)."""

    @property
    def dead_event(self) -> anyio.Event:
        """Set when the engines die or are stopped."""

    @property
    def failure(self) -> Exception | None:
        """Why an engine died, unless the engines were stopped on purpose."""

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A conversation through the chat template, as a prompt; ``InvalidInputError``."""

    def prepare(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
                grammar_after: tuple[int, ...] = (), constraint_param: str = "structured_outputs") -> PreparedPrompt:
        """Validate ``sampling_params`` (compiling its structured-output constraint, which
        applies after ``grammar_after`` when given and is reported as ``constraint_param``
        when it does not compile), tokenise and check ``prompt``, once;
        ``InvalidInputError`` (a 400 naming ``param``) and nothing is sent."""

    def generate(self, prompt: PreparedPrompt, sampling_params: None = None, request_id: str | None = None, *,
                 priority: int = 0, data_parallel_rank: int | None = None,
                 max_queue_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one prepared request's outputs; ``EngineDeadError`` if an engine dies,
        ``RequestTimeoutError`` if it waited past ``max_queue_time`` for its first step."""

    def engine_for(self, request_id: str) -> int | None:
        """The DP rank serving a request in progress (a metrics label)."""

    async def get_stats(self, engine: int = 0) -> dict[str, float]:
        """One engine's counts for ``/metrics``; ``EngineDeadError``."""

    async def sleep(self, level: int = 1) -> None:
        """Every engine drops its KV pool (level 2: its weights too); RuntimeError with
        requests in flight."""

    async def wake_up(self) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def start_profile(self, directory: str) -> None: ...

    async def stop_profile(self) -> None: ...
