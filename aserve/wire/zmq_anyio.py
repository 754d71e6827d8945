"""pyzmq under anyio (asyncio and Trio alike), over the socket's file descriptor.

A ZeroMQ socket's FD is edge-triggered: it signals "something changed", not "a message
is waiting", and any ``send`` or ``getsockopt(EVENTS)`` consumes the edge. So every
operation tries first without blocking, then checks ``zmq.EVENTS`` before it waits on
the FD, and checks again after waking. One task owns each socket's receiving side;
sends are synchronous (``NOBLOCK``) and never wait here, except the first sends of a
PUSH socket before its peer connects.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import zmq


class AsyncSocket:
    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket

    async def recv_multipart(self, *, copy: bool = True) -> list:
        """The next multipart message; cancellable while it waits."""
        sock = self.socket
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue
                await anyio.wait_readable(sock.FD)
                continue
            # One checkpoint per message, so a busy socket cannot starve other tasks.
            await anyio.lowlevel.checkpoint()
            return frames

    async def send_multipart(self, frames: list, *, copy: bool = True) -> None:
        """Send, waiting (cancellably) while the socket cannot take the message yet."""
        sock = self.socket
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                return
            except zmq.Again:
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                    continue
                await anyio.wait_readable(sock.FD)  # the FD signals writability as readable

    def send_nowait(self, frames: list, *, copy: bool = True) -> None:
        """Send without waiting; raises ``zmq.Again`` if the socket cannot take it now."""
        self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)

    def close(self, linger: int = 0) -> None:
        """Close; ``linger`` ms to deliver what is still queued (a last message)."""
        try:
            anyio.notify_closing(self.socket.FD)
        except (RuntimeError, zmq.ZMQError):
            pass
        self.socket.close(linger=linger)
