"""A lean HTTP/1.1 client for the load generator's streamed POSTs over plain TCP.

Why not httpx here: the load generator runs on the machine it measures, so its CPU per
streamed event is taken from the server under test. On the 7M model at 32 streams (two
cores shared by server and client), aserve read 1.2-1.4x vLLM with httpx driving both
and 1.6-2.7x with vLLM's own aiohttp client. This client
does only what the benchmark needs: keep-alive connections to one host, a POST with a
JSON body, and the response body as it arrives (chunked or with a length). httpx stays
in use for HTTP/2 and TLS.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc


class _Connection:
    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        self.buf += await self.stream.receive(1 << 16)  # EndOfStream when the server closes

    async def read_until(self, sep: bytes) -> bytes:
        start = 0
        while (i := self.buf.find(sep, start)) < 0:
            start = max(0, len(self.buf) - len(sep) + 1)
            await self._fill()
        out = bytes(self.buf[:i])
        del self.buf[: i + len(sep)]
        return out

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class Response:
    """A response whose body is read as it arrives (:meth:`aiter_bytes`, once; the
    names are httpx's, so the load generator reads both clients' responses alike)."""

    def __init__(self, conn: _Connection, status: int, headers: dict[bytes, bytes]) -> None:
        self._conn = conn
        self.status_code = status
        self.headers = headers
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self._length = int(headers.get(b"content-length", b"0"))
        self.complete = False  # the whole body was read: the connection can be reused

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if self._chunked:
            while True:
                size = int((await conn.read_until(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await conn.read_until(b"\r\n"):  # trailers, up to the empty line
                        pass
                    break
                data = await conn.read_exact(size)
                await conn.read_exact(2)
                yield data
        elif self._length:
            yield await conn.read_exact(self._length)
        self.complete = True

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])


class Http1Client:
    """Keep-alive HTTP/1.1 connections to the host of ``base_url`` (``http://`` only)."""

    def __init__(self, base_url: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"Http1Client speaks plain http://, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self._host_header = url.netloc.encode()
        self._idle: list[_Connection] = []

    @asynccontextmanager
    async def stream(self, method: str, url: str, *, content: bytes,
                     headers: dict[str, str] | None = None) -> AsyncIterator[Response]:
        """Send one request and yield its response, before the body is read. A
        connection whose response was read to the end goes back to the pool; any other
        is closed."""
        path = urllib.parse.urlsplit(url)
        target = (path.path or "/") + (f"?{path.query}" if path.query else "")
        lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: " + self._host_header,
                 b"Content-Type: application/json", b"Content-Length: " + str(len(content)).encode(),
                 b"Accept: */*", *(f"{k}: {v}".encode() for k, v in (headers or {}).items())]
        request = b"\r\n".join(lines) + b"\r\n\r\n" + content
        conn, head = await self._send(request)
        response = None
        try:
            fields: dict[bytes, bytes] = {}
            for line in head[1:]:
                name, _, value = line.partition(b":")
                fields[name.strip().lower()] = value.strip()
            response = Response(conn, int(head[0].split()[1]), fields)
            yield response
        finally:
            keep = (response is not None and response.complete
                    and response.headers.get(b"connection", b"").lower() != b"close")
            if keep:
                self._idle.append(conn)
            else:
                await conn.stream.aclose()

    async def _send(self, request: bytes) -> tuple[_Connection, list[bytes]]:
        """Send ``request`` and read the response's head: on a pooled connection first,
        which the server may have closed while it was idle (then once more on a new
        one, as httpx does), else on a new connection."""
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else _Connection(await anyio.connect_tcp(self.host, self.port))
            try:
                await conn.stream.send(request)
                return conn, (await conn.read_until(b"\r\n\r\n")).split(b"\r\n")
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                await conn.stream.aclose()
                if not reused:
                    raise
            except BaseException:
                await conn.stream.aclose()
                raise

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().stream.aclose()

    async def __aenter__(self) -> Http1Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
