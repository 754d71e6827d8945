"""The OpenAI-compatible HTTP application (Starlette), over an ``EngineClient``.

Routes (one module each; ``aserve.api.generation`` is the path the two generation routes
share):

=================================  ==========================================
``POST /v1/completions``           ``aserve.api.completions``
``POST /v1/chat/completions``      ``aserve.api.chat``
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /health``, ``GET /ready``, ``GET /metrics``  ``aserve.api.info``
=================================  ==========================================

Bad input is a 4xx with OpenAI's error body and the server goes on (``aserve.api.errors``);
a dead engine is a 503. A client that goes away cancels its request's work, which aborts
every engine request it started (every prompt, every ``n``). With ``--api-key``, every
``/v1`` route needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import functools
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from aserve.api import chat, completions, info
from aserve.api.errors import EXCEPTION_HANDLERS, error_response
from aserve.api.generation import ServerState

ROUTES = [
    ("/v1/completions", completions.create_completion, "POST"),
    ("/v1/chat/completions", chat.create_chat_completion, "POST"),
    ("/v1/models", info.models, "GET"),
    ("/tokenize", info.tokenize, "POST"),
    ("/detokenize", info.detokenize, "POST"),
    ("/version", info.version, "GET"),
    ("/health", info.health, "GET"),
    ("/ready", info.ready, "GET"),
    ("/metrics", info.metrics, "GET"),
]


def build_app(state: ServerState) -> Starlette:
    routes = [Route(path, functools.partial(handler, state), methods=[method]) for path, handler, method in ROUTES]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
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


__all__ = ["ServerState", "build_app"]
