"""The OpenAI-compatible HTTP application (Starlette), over an ``AsyncLLM``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /health``,
``GET /ready``, ``GET /metrics``. Bad input is a 4xx with OpenAI's error body and the
server goes on; a dead engine is a 503. A client that goes away cancels its request's
work, which aborts every engine request it started (every prompt, every ``n``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aserve
from aserve.api.metrics import Metrics
from aserve.api.protocol import ChatCompletionRequest, CompletionRequest, RequestError, decode_body
from aserve.api.responses import SSE_DONE, ComputedJSONResponse, EventStreamResponse, sse_event, unwrap_errors
from aserve.errors import EngineDeadError, InvalidInputError
from aserve.frontend.async_llm import AsyncLLM
from aserve.outputs import PositionLogprobs
from aserve.sampling_params import SamplingParams

DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)


def error_response(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}
    return JSONResponse({"error": {"message": message, "type": kind or kinds.get(status, "internal_error"),
                                   "param": param, "code": status}}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _Choice:
    """Accumulates one choice (prompt i, sample j) across DELTA outputs."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _Handler:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    # -- checks --------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.served_model_name:
            raise HTTPException(404, f"The model `{model}` does not exist.")

    def check_serving(self) -> None:
        if self.engine.is_dead:
            raise EngineDeadError("the engine is dead")
        if self.engine.ready is None:
            raise HTTPException(503, "the engines are starting")
        if self.state.draining:
            raise HTTPException(503, "the server is shutting down")

    def tokenize_prompts(self, prompts: list[Any], max_tokens: int | None) -> list[tuple[str | None, list[int]]]:
        out = []
        for prompt in prompts:
            text, ids = self.engine.input_processor.tokenize(prompt)
            if max_tokens is not None and len(ids) + max_tokens > self.engine.max_model_len:
                raise InvalidInputError(
                    f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                    "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
            out.append((text, ids))
        return out

    # -- shared generation loop ----------------------------------------------------------------

    def dp_rank(self, request: Request, req: Any) -> int | None:
        """The engine a request pins: the body's ``data_parallel_rank`` or vLLM's
        ``X-data-parallel-rank`` header; a 400 when out of range."""
        rank = req.data_parallel_rank
        header = request.headers.get("x-data-parallel-rank")
        if rank is None and header is not None:
            try:
                rank = int(header)
            except ValueError:
                raise InvalidInputError("X-data-parallel-rank must be an integer", param="data_parallel_rank") from None
        if rank is not None and not 0 <= rank < self.engine.num_engines:
            raise InvalidInputError(f"data_parallel_rank must be in [0, {self.engine.num_engines}), got {rank}",
                                    param="data_parallel_rank")
        return rank

    async def run_prompts(self, tokenized: list[tuple[str | None, list[int]]], params: SamplingParams, priority: int,
                          on_output: Any, data_parallel_rank: int | None = None) -> None:
        """Generate every prompt concurrently; ``on_output(prompt_index, RequestOutput)`` per delta.
        Cancelling the caller aborts them all. Metrics are labelled with the serving engine."""
        metrics = self.state.metrics

        async def one(i: int, text: str | None, ids: list[int]) -> None:
            start = last = time.monotonic()
            first = True
            request_id = f"{uuid.uuid4().hex}-{i}"
            engine_label = None
            async for out in self.engine.generate({"prompt": text, "prompt_token_ids": ids}, params,
                                                  request_id=request_id, priority=priority,
                                                  data_parallel_rank=data_parallel_rank):
                if engine_label is None:  # the engine is known once generate has started
                    engine_label = str(self.engine.engine_for(request_id))
                    metrics.prompt_tokens.labels(engine_label).inc(len(ids))
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

        with unwrap_errors():
            async with anyio.create_task_group() as tg:
                for i, (text, ids) in enumerate(tokenized):
                    tg.start_soon(one, i, text, ids)

    def disconnected(self) -> None:
        self.state.metrics.client_disconnected.inc()

    # -- /v1/completions ---------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        self.check_serving()
        req: CompletionRequest = decode_body(await read_body(request, self.state.max_body_bytes), CompletionRequest)
        self.check_model(req.model)
        params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs, default_max_tokens=16)
        self.engine.input_processor.check_params(params)
        tokenized = self.tokenize_prompts(req.prompts(), params.max_tokens)
        rid, created, model, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.state.served_model_name, params.n
        tok = self.engine.tokenizer
        choices = [_Choice(i) for i in range(len(tokenized) * n)]
        usage = {"prompt_tokens": sum(len(ids) for _, ids in tokenized), "completion_tokens": 0}

        def legacy_logprobs(c: _Choice, start_offset: int, positions: list[PositionLogprobs], ids: list[int]) -> dict:
            tokens, token_lps, tops, offsets, offset = [], [], [], [], start_offset
            for token, pos in zip(ids, positions):
                text = tok.decode([token], skip_special_tokens=False)
                tokens.append(text)
                token_lps.append(pos[token].logprob)
                tops.append({lp.decoded_token or "": lp.logprob for t, lp in pos.items() if t != token or
                             lp.rank is not None and lp.rank <= (req.logprobs or 0)})
                offsets.append(offset)
                offset += len(text)
            return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

        if req.stream:
            async def produce(write: Any) -> None:
                if req.echo:
                    for i, (text, ids) in enumerate(tokenized):
                        for j in range(n):
                            await write(sse_event(self._completion_chunk(rid, created, model, i * n + j,
                                                                         text if text is not None else tok.decode(ids),
                                                                         None, None)))

                async def on_output(i: int, out: Any) -> None:
                    for c in out.outputs:
                        choice = choices[i * n + c.index]
                        usage["completion_tokens"] += len(c.token_ids)
                        if not c.text and not c.token_ids and c.finish_reason is None:
                            continue
                        lps = (legacy_logprobs(choice, len(choice.text), c.logprobs or [], c.token_ids)
                               if req.logprobs is not None else None)
                        choice.text += c.text
                        await write(sse_event(self._completion_chunk(rid, created, model, choice.index, c.text, lps,
                                                                     c.finish_reason)))

                await self.run_prompts(tokenized, params, req.priority, on_output, self.dp_rank(request, req))
                if req.include_usage:
                    await write(sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                           "choices": [], "usage": self._usage(usage)}))
                await write(SSE_DONE)

            return EventStreamResponse(produce, self.disconnected)

        async def compute() -> tuple[int, Any]:
            async def on_output(i: int, out: Any) -> None:
                for c in out.outputs:
                    choice = choices[i * n + c.index]
                    choice.text += c.text
                    choice.token_ids += c.token_ids
                    choice.logprobs += c.logprobs or []
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

            await self.run_prompts(tokenized, params, req.priority, on_output, self.dp_rank(request, req))
            body_choices = []
            for choice in choices:
                text, ids = tokenized[choice.index // n]
                prefix = (text if text is not None else tok.decode(ids)) if req.echo else ""
                lps = legacy_logprobs(choice, len(prefix), choice.logprobs, choice.token_ids) if req.logprobs is not None else None
                usage["completion_tokens"] += len(choice.token_ids)
                body_choices.append({"index": choice.index, "text": prefix + choice.text, "logprobs": lps,
                                     "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
            return 200, {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": body_choices, "usage": self._usage(usage)}

        return ComputedJSONResponse(compute, self.disconnected)

    @staticmethod
    def _completion_chunk(rid: str, created: int, model: str, index: int, text: str, logprobs: Any,
                          finish_reason: str | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    @staticmethod
    def _usage(usage: dict[str, int]) -> dict[str, int]:
        return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    # -- /v1/chat/completions ----------------------------------------------------------------

    async def chat(self, request: Request) -> Any:
        self.check_serving()
        req: ChatCompletionRequest = decode_body(await read_body(request, self.state.max_body_bytes),
                                                 ChatCompletionRequest)
        self.check_model(req.model)
        tok = self.engine.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if not messages:
            raise RequestError("messages must not be empty", param="messages")
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=False)
        max_tokens = req.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs, default_max_tokens=max_tokens)
        self.engine.input_processor.check_params(params)
        tokenized = self.tokenize_prompts([{"prompt": text, "prompt_token_ids": ids}], params.max_tokens)
        rid, created, model, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.state.served_model_name, params.n
        choices = [_Choice(i) for i in range(n)]
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0}

        def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int]) -> dict:
            content = []
            for token, pos in zip(token_ids, positions):
                s = tok.decode([token], skip_special_tokens=False)
                top = [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode())}
                       for t, lp in pos.items() if t != token or (lp.rank or 0) <= (req.top_logprobs or 0)]
                content.append({"token": s, "logprob": pos[token].logprob, "bytes": list(s.encode()),
                                "top_logprobs": top[: req.top_logprobs or 0]})
            return {"content": content}

        def chunk(index: int, delta: dict, finish_reason: str | None = None, lps: Any = None) -> bytes:
            return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                              "choices": [{"index": index, "delta": delta, "logprobs": lps,
                                           "finish_reason": finish_reason}]})

        if req.stream:
            async def produce(write: Any) -> None:
                for j in range(n):
                    await write(chunk(j, {"role": "assistant", "content": ""}))

                async def on_output(i: int, out: Any) -> None:
                    for c in out.outputs:
                        usage["completion_tokens"] += len(c.token_ids)
                        lps = chat_logprobs(c.logprobs or [], c.token_ids) if req.logprobs else None
                        if c.text or c.token_ids:
                            await write(chunk(c.index, {"content": c.text}, None, lps))
                        if c.finish_reason is not None:
                            await write(chunk(c.index, {}, c.finish_reason))

                await self.run_prompts(tokenized, params, req.priority, on_output, self.dp_rank(request, req))
                if req.include_usage:
                    await write(sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [], "usage": self._usage(usage)}))
                await write(SSE_DONE)

            return EventStreamResponse(produce, self.disconnected)

        async def compute() -> tuple[int, Any]:
            async def on_output(i: int, out: Any) -> None:
                for c in out.outputs:
                    choice = choices[c.index]
                    choice.text += c.text
                    choice.token_ids += c.token_ids
                    choice.logprobs += c.logprobs or []
                    if c.finish_reason is not None:
                        choice.finish_reason = c.finish_reason

            await self.run_prompts(tokenized, params, req.priority, on_output, self.dp_rank(request, req))
            usage["completion_tokens"] = sum(len(c.token_ids) for c in choices)
            return 200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": chat_logprobs(c.logprobs, c.token_ids) if req.logprobs else None,
                                      "finish_reason": c.finish_reason} for c in choices],
                         "usage": self._usage(usage)}

        return ComputedJSONResponse(compute, self.disconnected)

    # -- small routes ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.state.served_model_name, "object": "model", "created": 0, "owned_by": "aserve",
            "max_model_len": self.engine.max_model_len}]})

    async def tokenize(self, request: Request) -> Response:
        body = decode_body(await read_body(request, self.state.max_body_bytes), dict)
        tok = self.engine.tokenizer
        if "messages" in body:
            text = tok.apply_chat_template(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True))
            tokens = tok.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            tokens = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise RequestError("give 'prompt' (a string) or 'messages'", param="prompt")
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body = decode_body(await read_body(request, self.state.max_body_bytes), dict)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.engine.input_processor.vocab_size
                                                   for t in tokens):
            raise RequestError("tokens must be a list of token ids", param="tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(tokens)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": aserve.__version__})

    async def health(self, request: Request) -> Response:
        if self.engine.is_dead:
            return error_response(503, "an engine is dead")
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        if self.engine.is_dead or self.state.draining or self.engine.ready is None:
            return error_response(503, "not ready")
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        if not self.engine.is_dead and self.engine.ready is not None:
            try:
                with anyio.fail_after(5):
                    for engine in range(self.engine.num_engines):
                        self.state.metrics.observe_stats(engine, await self.engine.get_stats(engine))
            except (EngineDeadError, TimeoutError):
                pass
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(state: ServerState) -> Starlette:
    handler = _Handler(state)

    async def on_http_exception(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    async def on_invalid_input(request: Request, exc: InvalidInputError) -> Response:
        return error_response(400, str(exc), param=exc.param)

    async def on_engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(503, f"the engine is dead: {exc}")

    routes = [
        Route("/v1/completions", handler.completions, methods=["POST"]),
        Route("/v1/chat/completions", handler.chat, methods=["POST"]),
        Route("/v1/models", handler.models, methods=["GET"]),
        Route("/tokenize", handler.tokenize, methods=["POST"]),
        Route("/detokenize", handler.detokenize, methods=["POST"]),
        Route("/version", handler.version, methods=["GET"]),
        Route("/health", handler.health, methods=["GET"]),
        Route("/ready", handler.ready, methods=["GET"]),
        Route("/metrics", handler.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        HTTPException: on_http_exception, InvalidInputError: on_invalid_input, EngineDeadError: on_engine_dead,
    })
    if state.api_key is None:
        return app

    expected = f"Bearer {state.api_key}".encode()

    async def with_api_key(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != expected:
                await error_response(401, "a valid API key is required (Authorization: Bearer ...)")(scope, receive, send)
                return
        await app(scope, receive, send)

    return with_api_key  # type: ignore[return-value]
