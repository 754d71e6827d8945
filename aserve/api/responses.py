"""ASGI responses that end their work when the client goes away.

Both kinds run their producer in a task group next to a task that waits for
``http.disconnect``; a disconnect (HTTP/1.1 close, HTTP/2 RST_STREAM) cancels the
producer, whose ``generate`` iterators then abort their engine requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


import anyio
import msgspec

from aserve.api.errors import error_event
from aserve.errors import AserveError, unwrap_errors

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def json_bytes(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def sse_event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class _WatchedResponse:
    def __init__(self, on_disconnect: Callable[[], None] | None = None) -> None:
        self._on_disconnect = on_disconnect
        self.disconnected = False

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                if self._on_disconnect is not None:
                    self._on_disconnect()
                scope.cancel()
                return


class EventStreamResponse(_WatchedResponse):
    """200 ``text/event-stream``; ``produce(write)`` writes whole SSE events."""

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
                 on_disconnect: Callable[[], None] | None = None) -> None:
        super().__init__(on_disconnect)
        self._produce = produce

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        ]})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, receive, tg.cancel_scope)
            try:
                with unwrap_errors():
                    await self._produce(write)
            except AserveError as exc:
                # Headers are out: say it in the stream, as OpenAI does (the client
                # raises), then end it as every stream ends.
                await write(sse_event(error_event(exc)))
                await write(SSE_DONE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


class ComputedJSONResponse(_WatchedResponse):
    """A JSON response whose body ``compute()`` returns as (status, object)."""

    def __init__(self, compute: Callable[[], Awaitable[tuple[int, Any]]],
                 on_disconnect: Callable[[], None] | None = None) -> None:
        super().__init__(on_disconnect)
        self._compute = compute

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        result: list[tuple[int, Any]] = []
        with unwrap_errors():
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                result.append(await self._compute())
                tg.cancel_scope.cancel()
        if not result:
            return  # the client is gone: nothing to send
        status, obj = result[0]
        body = json_bytes(obj)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
