"""Opening a wire-1 ZeroMQ socket: the one place its options are set.

Every socket aserve opens is made here, so they all agree on the options that matter for
shutdown and security:

- ``LINGER`` 0 unless asked (a closed socket never holds the process; a last message,
  such as ``ENGINE_CORE_DEAD``, is given its linger at ``close`` instead);
- CURVE on every ``tcp://`` address (``aserve.wire.auth``): the binder is the CURVE
  server, the connecter its client, both keyed by the shared secret;
- a DEALER's identity (the engine's DP rank, two little-endian bytes), a SUB that takes
  every topic, an XPUB that reports every subscription; a ROUTER raises on a message
  for an unknown peer only when asked (``router_mandatory``: an API server must know
  that an engine is not there; the coordinator's wave messages may miss a late engine).
"""

from __future__ import annotations

import zmq

from aserve.wire.auth import secure_client, secure_server
from aserve.wire.zmq_anyio import AsyncSocket


def open_socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool, secret: bytes | None = None,
                identity: bytes | None = None, linger: int = 0,
                router_mandatory: bool = False, connect: bool = True) -> AsyncSocket:
    """A socket of ``kind`` bound to (``bind=True``) or connected to ``address``;
    ``connect=False`` only prepares it (CURVE included) for the caller to connect, say
    once it has attached a monitor that must see the first attempt."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER and router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    elif kind == zmq.XPUB:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first per topic
    try:
        if bind:
            if address.startswith("tcp://"):
                secure_server(sock, secret)
            sock.bind(address)
        else:
            if address.startswith("tcp://"):
                secure_client(sock, secret)
            if connect:
                sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return AsyncSocket(sock)


def endpoint(sock: AsyncSocket) -> str:
    """The address a socket was bound to, with the port the kernel gave a ``tcp://*:0``."""
    return sock.socket.last_endpoint.decode()
