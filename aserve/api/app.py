"""The OpenAI-compatible HTTP application (Starlette), over an ``EngineClient``.

Routes (one module each; ``aserve.api.generation`` is the path the two generation routes
share):

=================================  ==========================================
``POST /v1/completions``           ``aserve.api.completions``
``POST /v1/chat/completions``      ``aserve.api.chat``
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /openapi.json``,
``GET /health``, ``GET /ready``, ``GET /metrics``  ``aserve.api.info``
=================================  ==========================================

Bad input is a 4xx with OpenAI's error body and the server goes on (``aserve.api.errors``);
a dead engine is a 503, anything unexpected a 500 with the same body and no detail (the
traceback goes to the log, never to the client). A client that goes away cancels its
request's work, which aborts every engine request it started (every prompt, every ``n``).

With ``--api-key``, every route needs ``Authorization: Bearer KEY`` (compared in
constant time) except the probes (``/health``, ``/ready``, ``/metrics``), which an
orchestrator polls without secrets; ``--api-key-probes`` covers them too. CORS is off (no
``Access-Control-*`` headers at all) unless ``--allowed-origins`` names origins.
"""

from __future__ import annotations

import functools
import hmac
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from aserve.api import chat, completions, dev, info
from aserve.api.errors import EXCEPTION_HANDLERS, error_response
from aserve.api.generation import ServerState

ROUTES = [
    ("/v1/completions", completions.create_completion, "POST"),
    ("/v1/chat/completions", chat.create_chat_completion, "POST"),
    ("/v1/models", info.models, "GET"),
    ("/tokenize", info.tokenize, "POST"),
    ("/detokenize", info.detokenize, "POST"),
    ("/version", info.version, "GET"),
    ("/openapi.json", info.openapi, "GET"),
    ("/health", info.health, "GET"),
    ("/ready", info.ready, "GET"),
    ("/metrics", info.metrics, "GET"),
]


#: Open without the API key unless ``--api-key-probes``: what Kubernetes and Prometheus poll.
PROBES = frozenset({"/health", "/ready", "/metrics"})


def build_app(state: ServerState) -> Starlette:
    table = ROUTES + (dev.ROUTES if state.enable_dev_endpoints else [])  # sleep, profile: aserve.api.dev
    routes = [Route(path, functools.partial(handler, state), methods=[method]) for path, handler, method in table]
    middleware = []
    if state.allowed_origins:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, middleware=middleware)
    if state.api_key is None:
        return app

    expected = f"Bearer {state.api_key}".encode()
    open_paths = frozenset() if state.api_key_probes else PROBES

    async def with_api_key(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in open_paths and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await error_response(401, "a valid API key is required (Authorization: Bearer ...)")(scope, receive, send)
                return
        await app(scope, receive, send)

    return with_api_key  # type: ignore[return-value]


__all__ = ["ServerState", "build_app"]
