"""OpenAI's error body, and the handlers that turn aserve's exceptions into it: bad input
is a 400 naming ``param``, a dead engine a 503, Starlette's HTTP errors keep their code."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.errors import EngineDeadError, InvalidInputError

logger = logging.getLogger("aserve.api")

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


def error_response(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind or _KINDS.get(status, "internal_error"),
                                   "param": param, "code": status}}, status_code=status)


async def on_http_exception(request: Request, exc: HTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


async def on_invalid_input(request: Request, exc: InvalidInputError) -> Response:
    return error_response(400, str(exc), param=exc.param)


async def on_engine_dead(request: Request, exc: EngineDeadError) -> Response:
    return error_response(503, f"the engine is dead: {exc}")


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: OpenAI's body with no detail (no traceback, no path); the log has it all."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", kind="internal_error")


EXCEPTION_HANDLERS = {HTTPException: on_http_exception, InvalidInputError: on_invalid_input,
                      EngineDeadError: on_engine_dead, Exception: on_unexpected}
