"""The generation path the OpenAI routes share: checks, prompts, ``n``, metrics.

A request goes ``route`` (``aserve.api.completions`` / ``aserve.api.chat``) ->
:func:`check_serving` and the body's schema -> ``EngineClient.prepare`` for each prompt
(4xx before anything is sent) -> :func:`run_prompts`, which streams every prompt's
deltas to the route's ``on_output`` and records the metrics, labelled by the engine that
served it. Cancelling the route's task (the client went away) aborts every engine
request it started, every prompt and every ``n``. Structured outputs and tool calls
belong between the body and ``prepare`` (what the model may generate) and in the
routes' ``on_output`` (how the text is returned).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request

from aserve.api.admission import Admission, AdmissionCounters, Ticket
from aserve.api.limits import Deadlines, ServerLimits
from aserve.api.metrics import Metrics
from aserve.api.responses import unwrap_errors
from aserve.errors import EngineDeadError, InvalidInputError, RequestTimeoutError
from aserve.frontend.engine_client import EngineClient
from aserve.frontend.input_processor import PreparedPrompt
from aserve.outputs import PositionLogprobs, RequestOutput

DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass
class ServerState:
    engine: EngineClient
    served_model_name: str  # what responses and /v1/models report
    api_key: str | None = None
    api_key_probes: bool = False  # the key on the probes (/health, /ready, /metrics) too
    allowed_origins: tuple[str, ...] = ()  # CORS origins; empty: no CORS headers at all
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    # Every name a request's ``model`` may give (the first is ``served_model_name``).
    served_model_names: tuple[str, ...] = ()
    tool_call_parser: str | None = None  # --tool-call-parser: reads tool_choice "auto"'s calls
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice (with a parser)
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning_content apart
    limits: ServerLimits = field(default_factory=ServerLimits)  # admission, deadlines, bounds
    enable_dev_endpoints: bool = False  # --enable-dev-endpoints: /sleep, /wake_up, /start_profile (aserve.api.dev)
    profiler_dir: str | None = None  # --profiler-dir: where /stop_profile writes the traces
    # This API server's slot of the server-wide admission counts (None: private counts,
    # as one API server, or a test, has).
    admission_counters: AdmissionCounters | None = None
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits.admission, self.admission_counters or AdmissionCounters(),
                                   on_refused=lambda reason: self.metrics.requests_refused.labels(reason).inc())

    def accepts(self, model: str) -> bool:
        return model == self.served_model_name or model in self.served_model_names


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_serving(state: ServerState) -> None:
    """503 while the engines start, once one died, and while the server drains."""
    if state.engine.is_dead:
        raise EngineDeadError("the engine is dead")
    if state.engine.ready is None:
        raise HTTPException(503, "the engines are starting")
    if state.draining:
        raise HTTPException(503, "the server is shutting down")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and not state.accepts(model):
        raise HTTPException(404, f"The model `{model}` does not exist.")


def dp_rank(state: ServerState, request: Request, req: Any) -> int | None:
    """The engine a request pins: the body's ``data_parallel_rank`` or vLLM's
    ``X-data-parallel-rank`` header; a 400 when out of range, when the header is not an
    integer (even beside the body's field), or when the two disagree."""
    rank = req.data_parallel_rank
    header = request.headers.get("x-data-parallel-rank")
    if header is not None:
        try:
            pinned = int(header)
        except ValueError:
            raise InvalidInputError("X-data-parallel-rank must be an integer", param="data_parallel_rank") from None
        if rank is not None and rank != pinned:
            raise InvalidInputError(f"data_parallel_rank is {rank} in the body and {pinned} in the "
                                    "X-data-parallel-rank header", param="data_parallel_rank")
        rank = pinned
    num_engines = state.engine.num_engines
    if rank is not None and not 0 <= rank < num_engines:
        raise InvalidInputError(f"data_parallel_rank must be in [0, {num_engines}), got {rank}",
                                param="data_parallel_rank")
    return rank


class Choice:
    """Accumulates one choice (prompt i, sample j) across DELTA outputs."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, c: Any) -> None:
        """Append one delta (a ``CompletionOutput``) of this choice."""
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def usage_body(usage: dict[str, int]) -> dict[str, int]:
    return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


OnOutput = Callable[[int, RequestOutput], Awaitable[None]]


async def run_prompts(state: ServerState, prepared: list[PreparedPrompt], priority: int, on_output: OnOutput,
                      data_parallel_rank: int | None = None, *, ticket: Ticket | None = None,
                      deadlines: Deadlines = Deadlines()) -> None:
    """Generate every prompt concurrently; ``on_output(prompt_index, RequestOutput)`` per
    delta. Cancelling the caller aborts them all. Metrics are labelled with the serving
    engine. ``ticket``, the request's admission, is told of each first token and released
    at the end, whatever the end. Past ``deadlines`` every prompt is aborted and
    ``RequestTimeoutError`` raised."""
    try:
        await _run_prompts(state, prepared, priority, on_output, data_parallel_rank, ticket, deadlines)
    except RequestTimeoutError as exc:
        state.metrics.request_timeouts.labels(exc.param).inc()
        raise
    finally:
        if ticket is not None:
            ticket.release()


async def _run_prompts(state: ServerState, prepared: list[PreparedPrompt], priority: int, on_output: OnOutput,
                       data_parallel_rank: int | None, ticket: Ticket | None, deadlines: Deadlines) -> None:
    metrics, engine = state.metrics, state.engine

    async def one(i: int, prompt: PreparedPrompt) -> None:
        start = last = time.monotonic()
        first = True
        request_id = f"{uuid.uuid4().hex}-{i}"
        engine_label = None
        async for out in engine.generate(prompt, request_id=request_id, priority=priority,
                                         data_parallel_rank=data_parallel_rank,
                                         max_queue_time=deadlines.max_queue_time):
            if engine_label is None:  # the engine is known once generate has started
                engine_label = str(engine.engine_for(request_id))
                metrics.prompt_tokens.labels(engine_label).inc(len(prompt.token_ids))
                # This request's series, looked up once (``labels`` locks and hashes).
                generation_tokens = metrics.generation_tokens.labels(engine_label)
                itl = metrics.itl.labels(engine_label)
            now = time.monotonic()
            if first and "queue_time" in out.metrics:
                metrics.queue_time.labels(engine_label).observe(out.metrics["queue_time"])
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            if new_tokens:
                generation_tokens.inc(new_tokens)
                if first:
                    if ticket is not None:
                        ticket.prefilled(i)
                    metrics.ttft.labels(engine_label).observe(now - start)
                    first = False
                else:
                    itl.observe((now - last) / new_tokens)
                last = now
            for c in out.outputs:
                if c.finish_reason is not None:
                    metrics.request_success.labels(engine_label, c.finish_reason).inc()
            if out.finished:
                metrics.e2e.labels(engine_label).observe(now - start)
            await on_output(i, out)

    expires_at = float("inf") if deadlines.expires_at is None else deadlines.expires_at
    with anyio.move_on_after(expires_at - time.monotonic()) as scope:
        with unwrap_errors():
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(prepared):
                    tg.start_soon(one, i, prompt)
    if scope.cancelled_caught:  # every prompt's engine requests were aborted on the way out
        raise RequestTimeoutError(f"the request took longer than request_timeout={deadlines.request_timeout} s "
                                  "and was aborted", param="request_timeout")


def disconnected(state: ServerState) -> Callable[[], None]:
    """The hook a response calls when its client goes away (a metric)."""
    return state.metrics.client_disconnected.inc
