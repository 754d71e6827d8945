"""The small routes: ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/version``,
``/openapi.json`` (``aserve.api.openapi``), and the
probes ``/health`` (200 while every engine lives), ``/ready`` (200 once every engine is
ready and the server is not draining) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve import __version__
from aserve.api.errors import error_response
from aserve.api.generation import ServerState, read_body
from aserve.api.openapi import openapi_document
from aserve.api.protocol import DetokenizeRequest, RequestError, TokenizeRequest, decode_body
from aserve.api.tools import template_messages
from aserve.errors import EngineDeadError


async def models(state: ServerState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": 0, "owned_by": "aserve",
        "max_model_len": state.engine.max_model_len}]})


async def tokenize(state: ServerState, request: Request) -> Response:
    # Typed like the chat route's body: a malformed field is a 400 naming it, never a 500.
    body = decode_body(await read_body(request, state.max_body_bytes), TokenizeRequest)
    if body.messages is not None:
        rendered = state.engine.render_chat(template_messages(body.messages),
                                            add_generation_prompt=body.add_generation_prompt)
        tokens = rendered["prompt_token_ids"]
    elif body.prompt is not None:
        tokens = state.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise RequestError("give 'prompt' (a string) or 'messages'", param="prompt")
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len})


async def detokenize(state: ServerState, request: Request) -> Response:
    body = decode_body(await read_body(request, state.max_body_bytes), DetokenizeRequest)
    vocab_size = state.engine.vocab_size
    if not all(0 <= t < vocab_size for t in body.tokens):
        raise RequestError(f"tokens must be token ids in [0, {vocab_size})", param="tokens")
    return JSONResponse({"prompt": state.engine.tokenizer.decode(body.tokens)})


async def openapi(state: ServerState, request: Request) -> Response:
    engine = state.engine
    names = tuple(dict.fromkeys((state.served_model_name, *state.served_model_names)))
    return JSONResponse(openapi_document(names, state.limits, engine.max_model_len, engine.vocab_size,
                                         engine.num_engines))


async def version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def health(state: ServerState, request: Request) -> Response:
    if state.engine.is_dead:
        return error_response(503, "an engine is dead")
    return Response(status_code=200)


async def ready(state: ServerState, request: Request) -> Response:
    if state.engine.is_dead or state.draining or state.engine.ready is None:
        return error_response(503, "not ready")
    return Response(status_code=200)


async def metrics(state: ServerState, request: Request) -> Response:
    engine = state.engine
    if not engine.is_dead and engine.ready is not None:
        try:
            with anyio.fail_after(5):
                for index in range(engine.num_engines):
                    state.metrics.observe_stats(index, await engine.get_stats(index))
        except (EngineDeadError, TimeoutError):
            pass
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
