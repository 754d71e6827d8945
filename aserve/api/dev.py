"""The development routes, present only with ``--enable-dev-endpoints`` (as vLLM's):
sleep, wake up, and profile every worker of every engine (docs/serving.md, "Sleep and
profile").

=============================  =====================================================
``POST /sleep?level=1``        drop every engine's KV pool (level 2: the weights too)
``POST /wake_up``              undo it; requests meanwhile get 503
``GET /is_sleeping``           ``{"is_sleeping": bool}``
``POST /start_profile``        every worker records a ``torch.profiler`` trace
``POST /stop_profile``         write them, one file per worker, into ``--profiler-dir``
=============================  =====================================================

They reach the engines of this API server's ``AsyncLLM``, which are every engine of the
server. A sleep with requests in flight, or a profile that cannot start or stop, is a 409
naming why.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.api.errors import error_response
from aserve.api.generation import ServerState
from aserve.api.protocol import RequestError


async def sleep(state: ServerState, request: Request) -> Response:
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise RequestError(f"level must be 1 or 2, got {raw!r}", param="level")
    return await _call(state.engine.sleep(int(raw)))


async def wake_up(state: ServerState, request: Request) -> Response:
    return await _call(state.engine.wake_up())


async def is_sleeping(state: ServerState, request: Request) -> Response:
    return JSONResponse({"is_sleeping": await state.engine.is_sleeping()})


async def start_profile(state: ServerState, request: Request) -> Response:
    if state.profiler_dir is None:
        raise RequestError("this server has no --profiler-dir to write traces into", param="profiler_dir")
    return await _call(state.engine.start_profile(state.profiler_dir))


async def stop_profile(state: ServerState, request: Request) -> Response:
    return await _call(state.engine.stop_profile())


async def _call(call: object) -> Response:
    try:
        await call  # type: ignore[misc]
    except RuntimeError as exc:  # the engine refused (requests in flight, no profile running)
        return error_response(409, str(exc).split(": ", 1)[-1], kind="invalid_request_error")
    return Response(status_code=200)


ROUTES = [
    ("/sleep", sleep, "POST"),
    ("/wake_up", wake_up, "POST"),
    ("/is_sleeping", is_sleeping, "GET"),
    ("/start_profile", start_profile, "POST"),
    ("/stop_profile", stop_profile, "POST"),
]
