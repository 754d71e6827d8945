"""OpenAI's error body, and the handlers that turn aserve's exceptions into it: bad input
is a 400 naming ``param`` (a limit past which a request is refused too), a full server a
429 with ``Retry-After``, a passed deadline a 408 naming it, a dead engine a 503;
Starlette's HTTP errors keep their code. A stream whose headers are out says the same
in an error event (:func:`error_event`)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.errors import (
    AserveError,
    EngineDeadError,
    EngineSleepingError,
    InvalidInputError,
    RequestRefusedError,
    RequestTimeoutError,
)

logger = logging.getLogger("aserve.api")

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


def error_body(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or _KINDS.get(status, "internal_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, *, param: str | None = None, kind: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, kind=kind), status_code=status, headers=headers)


def described(exc: AserveError) -> tuple[int, str, str | None]:
    """(status, message, param) of one of aserve's errors, as a client sees it."""
    if isinstance(exc, InvalidInputError):
        return 400, str(exc), exc.param
    if isinstance(exc, RequestRefusedError):
        return 429, str(exc), exc.reason
    if isinstance(exc, RequestTimeoutError):
        return 408, str(exc), exc.param
    if isinstance(exc, EngineDeadError):
        return 503, f"the engine is dead: {exc}", None
    if isinstance(exc, EngineSleepingError):
        return 503, str(exc), None
    return 500, "internal server error", None


def error_event(exc: AserveError) -> dict:
    """The body of the SSE event that ends a stream which failed after its headers."""
    status, message, param = described(exc)
    return error_body(status, message, param=param)


async def on_http_exception(request: Request, exc: HTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


async def on_invalid_input(request: Request, exc: InvalidInputError) -> Response:
    return error_response(400, str(exc), param=exc.param)


async def on_engine_dead(request: Request, exc: EngineDeadError) -> Response:
    return error_response(503, f"the engine is dead: {exc}")


async def on_sleeping(request: Request, exc: EngineSleepingError) -> Response:
    return error_response(503, str(exc))


async def on_refused(request: Request, exc: RequestRefusedError) -> Response:
    return error_response(429, str(exc), param=exc.reason, headers={"Retry-After": str(exc.retry_after)})


async def on_timeout(request: Request, exc: RequestTimeoutError) -> Response:
    return error_response(408, str(exc), param=exc.param)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: OpenAI's body with no detail (no traceback, no path); the log has it all."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", kind="internal_error")


EXCEPTION_HANDLERS = {HTTPException: on_http_exception, InvalidInputError: on_invalid_input,
                      EngineDeadError: on_engine_dead, EngineSleepingError: on_sleeping, RequestRefusedError: on_refused,
                      RequestTimeoutError: on_timeout, Exception: on_unexpected}
