"""The load generator's lean HTTP/1.1 client against a scripted TCP server."""

from __future__ import annotations

import anyio
import pytest

from aserve.bench.http1 import Http1Client

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def read_request(stream, buf: bytearray) -> bytes:
    """One request (head and Content-Length body) from ``stream``; leftover in ``buf``."""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive()
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += await stream.receive()
    buf[:] = rest[length:]
    return head + b"\r\n\r\n" + rest[:length]


async def serve(responses: list[bytes], close_after: set[int], seen: list[tuple[int, bytes]]):
    """A listener that answers the i-th request with responses[i], closing its
    connection after the requests in ``close_after``; records (connection, request)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    count = {"requests": 0, "connections": 0}

    async def handle(stream):
        conn = count["connections"]
        count["connections"] += 1
        buf = bytearray()
        async with stream:
            while True:
                try:
                    request = await read_request(stream, buf)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                i = count["requests"]
                count["requests"] += 1
                seen.append((conn, request))
                await stream.send(responses[i])
                if i in close_after:
                    return

    return listener, handle


async def test_chunked_and_sized_bodies_over_one_kept_alive_connection():
    seen: list[tuple[int, bytes]] = []
    responses = [
        # chunked, split oddly, with a chunk extension and a trailer
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-T: 1\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot there",
    ]
    listener, handle = await serve(responses, set(), seen)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        async with Http1Client(f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", content=b'{"a": 1}',
                                     headers={"Authorization": "Bearer k"}) as response:
                assert response.status_code == 200
                assert [c async for c in response.aiter_bytes()] == [b"hello", b", world"]
            async with client.stream("POST", f"http://127.0.0.1:{port}/x?y=1", content=b"{}") as response:
                assert response.status_code == 404 and await response.aread() == b"not there"
        tg.cancel_scope.cancel()
    assert [conn for conn, _ in seen] == [0, 0]  # the second request reused the connection
    first = seen[0][1]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n") and first.endswith(b'\r\n\r\n{"a": 1}')
    assert b"\r\nAuthorization: Bearer k\r\n" in first and b"\r\nContent-Length: 8\r\n" in first
    assert seen[1][1].startswith(b"POST /x?y=1 HTTP/1.1\r\n")


async def test_a_connection_the_server_closed_is_replaced_and_an_unread_one_dropped():
    seen: list[tuple[int, bytes]] = []
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"
    listener, handle = await serve([ok, ok, chunked, ok], {0}, seen)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    url = f"http://127.0.0.1:{port}/"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        async with Http1Client(url) as client:
            for _ in range(2):  # the server closes the first connection after answering
                async with client.stream("POST", url, content=b"{}") as response:
                    assert await response.aread() == b"ok"
            async with client.stream("POST", url, content=b"{}") as response:
                pass  # body not read: the connection cannot be reused
            async with client.stream("POST", url, content=b"{}") as response:
                assert await response.aread() == b"ok"
        tg.cancel_scope.cancel()
    assert [conn for conn, _ in seen] == [0, 1, 1, 2]


def test_only_plain_http():
    with pytest.raises(ValueError, match="plain http"):
        Http1Client("https://example.com")
