"""The load generator's streamed POSTs over plain-http HTTP/1.1, through aiohttp (asyncio
and uvloop only; HTTP/2 and TLS go through httpx), behind httpx's small interface:
``stream()`` yields a response with ``status_code``, ``aiter_bytes()`` and ``aread()``.

Why aiohttp (``docs/benchmarks.md``): the load generator shares the machine it measures,
so its CPU per streamed event matters. httpx's was too high; a hand-written 146-line
HTTP/1.1 client replaced it, and then measured the same as aiohttp (vLLM's load
generator's library): 138-151 against 130-151 us of client CPU per event, three rounds
alternating on one server. aiohttp is the less code to keep."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


class _Response:
    def __init__(self, response: Any) -> None:
        self._response = response
        self.status_code = response.status

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aread(self) -> bytes:
        return await self._response.read()


class AiohttpClient:
    def __init__(self, limit: int, timeout: float) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=timeout))

    @asynccontextmanager
    async def stream(self, method: str, url: str, *, content: bytes,
                     headers: dict[str, str] | None = None) -> AsyncIterator[_Response]:
        async with self._session.request(method, url, data=content,
                                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
            yield _Response(r)

    async def __aenter__(self) -> AiohttpClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._session.close()
