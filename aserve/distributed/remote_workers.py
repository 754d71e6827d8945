"""The engine core's calls to the workers of an engine on other machines, and their
replies: ZeroMQ over TCP, CURVE-authenticated with the server's shared secret.

On its own machine the engine core writes each call once to the shared-memory broadcast
ring. For the workers of the other nodes it also publishes the same bytes (msgspec's
msgpack of a ``WorkerCall``; nothing is pickled) on one PUB socket, bound on the head at
``master_port + 1``; every remote worker subscribes. Replies (READY, a step's output from
the output rank, a utility call's result) come back on one PULL socket at
``master_port + 2``, each as ``[rank, payload]``.

Progress: a remote worker's layers move no counter the head can read, so each remote
worker sends ``[rank, b""]`` (a reply is never empty) when it finishes a layer at least
``PING_INTERVAL`` after its last such ping: at most one a second, and only while its
layers run. The head counts them (:meth:`RemoteWorkers.progress`) beside its local
workers' progress counters, so a step that keeps finishing layers on another node (a
pipeline stage of its own there, running a long prefill) is waited for, as a local one
is, and a stuck one, which finishes none, is not.

Failure, both ways:

- The head watches its PULL socket: a remote worker whose connection drops (the process
  died, or its node went) is an ``EngineDeadError``, as a local worker's exit is.
- A remote worker watches its SUB socket: once connected, a dropped connection means the
  head is gone, and ``CallSubscriber.read`` raises ``HeadLostError``; the worker exits.

A peer without the secret fails the CURVE handshake and never sees a call. The
``torch.distributed`` rendezvous (a TCPStore at ``master_port``) and gloo's own TCP
connections are not authenticated, as in vLLM: run the nodes on a private network.
"""

from __future__ import annotations

import collections
import struct
import time

import zmq

from aserve.errors import EngineDeadError
from aserve.wire.auth import secure_client, secure_server

_RANK = struct.Struct("<I")
#: Seconds between a remote worker's progress pings, at most one per interval.
PING_INTERVAL = 1.0
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH \
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class HeadLostError(RuntimeError):
    """The head node's engine core went away (or refused this node's secret)."""


def call_address(master_addr: str, master_port: int) -> str:
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"tcp://{host}:{master_port + 1}"


def reply_address(master_addr: str, master_port: int) -> str:
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"tcp://{host}:{master_port + 2}"


def _events(monitor: zmq.Socket) -> list[int]:
    """The socket events waiting on ``monitor``, without blocking."""
    events = []
    while monitor.poll(0):
        frames = monitor.recv_multipart()
        events.append(struct.unpack("=hi", frames[0][:6])[0])
    return events


class RemoteWorkers:
    """The head's side: publish calls to the remote workers, read their replies."""

    def __init__(self, ctx: zmq.Context, *, master_addr: str, master_port: int, ranks: list[int],
                 secret: bytes | None) -> None:
        """``ranks``: the workers on other nodes."""
        self.ranks = ranks
        self._pub = ctx.socket(zmq.PUB)
        self._pull = ctx.socket(zmq.PULL)
        for sock in (self._pub, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, secret)
        self._monitor = self._pull.get_monitor_socket(_EVENTS)
        # On every interface: ``master_addr`` is how the other nodes reach the head (in
        # Kubernetes a DNS name, which a bind cannot take); CURVE keeps strangers out.
        self._pub.bind(call_address("*", master_port))
        self._pull.bind(reply_address("*", master_port))
        self._pending: dict[int, collections.deque[bytes]] = {rank: collections.deque() for rank in ranks}
        self._joined = 0  # reply connections that completed their handshake
        self._pings = 0  # progress pings received from every remote worker so far

    def publish(self, payload: bytes) -> None:
        self._pub.send(payload)

    def check(self) -> None:
        """``EngineDeadError`` when a remote worker's connection dropped."""
        for event in _events(self._monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._joined += 1
            elif event == zmq.EVENT_DISCONNECTED and self._joined:
                raise EngineDeadError("a worker on another node disconnected (its process or its node died)")
            # Otherwise a peer that failed the CURVE handshake (it gets nothing), or a drop
            # before any worker joined: neither is a failure of this engine.

    def read(self, rank: int, timeout: float) -> bytes:
        """The next reply of remote worker ``rank``; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self._pending[rank]:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._pull.poll(int(remaining * 1000) + 1):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                continue
            self._take(self._pull.recv_multipart())
        return self._pending[rank].popleft()

    def progress(self) -> int:
        """How many progress pings the remote workers have sent so far: the replies
        waiting are taken into their queues, the pings counted; never blocks. A move
        between two looks means some remote worker finished a layer in between."""
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self._pings
            self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != _RANK.size:
            return
        if not frames[1]:
            self._pings += 1
            return
        sender = _RANK.unpack(frames[0])[0]
        if sender in self._pending:
            self._pending[sender].append(frames[1])

    def close(self) -> None:
        self._monitor.close(linger=0)
        self._pub.close(linger=0)
        self._pull.close(linger=0)


class CallSubscriber:
    """A remote worker's side of the calls: :meth:`read` as ``ShmRingReader.read``."""

    def __init__(self, ctx: zmq.Context, address: str, secret: bytes | None, *, subscribe: bool = True) -> None:
        """``subscribe`` False: only the connection is watched (a node's supervisor)."""
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        if subscribe:
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(self._sub, secret)
        self._monitor = self._sub.get_monitor_socket(_EVENTS)
        self._sub.connect(address)
        self._connected = False
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _check(self) -> None:
        for event in _events(self._monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                raise HeadLostError("the head node went away")
            elif event != zmq.EVENT_DISCONNECTED:  # one of the handshake failures
                raise HeadLostError("the head node refused this node's CURVE handshake: the secret differs")

    def wait_connected(self, timeout: float) -> None:
        """Until the handshake with the head succeeded; HeadLostError if it was refused,
        TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self._connected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no connection to the head node")
            self._monitor.poll(int(remaining * 1000) + 1)
            self._check()

    def wait_event(self, timeout: float) -> None:
        """Sleep until the connection changes or ``timeout`` s pass; HeadLostError when
        the head's connection dropped."""
        self._monitor.poll(int(timeout * 1000))
        self._check()

    def read(self) -> bytes:
        """The next call; sleeps until one comes (no timer). HeadLostError when the
        head's connection drops."""
        while True:
            self._check()
            if self._sub.poll(0):
                return self._sub.recv()
            self._poller.poll()

    def close(self) -> None:
        self._monitor.close(linger=0)
        self._sub.close(linger=0)


class ReplyPusher:
    """A remote worker's replies: :meth:`write` as ``ShmRingWriter.write``."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, secret: bytes | None, *,
                 ping_interval: float = PING_INTERVAL) -> None:
        self.ping_interval = ping_interval
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        secure_client(self._push, secret)
        self._push.connect(address)
        self._rank = _RANK.pack(rank)
        self._pinged = time.monotonic()

    def wait_for_readers(self, timeout: float) -> None:  # noqa: ARG002 (the ring's interface)
        return

    def write(self, payload: bytes) -> None:
        """A reply (msgpack: never empty, which a ping is)."""
        self._push.send_multipart([self._rank, payload])

    def layer_done(self) -> None:
        """A layer of a step finished (the model's thread, which also writes the
        replies: the socket has one user): a progress ping, if the last one (or the
        socket's start) is ``ping_interval`` old. Never blocks the step: a ping the
        socket cannot take now is dropped, as the next one says the same."""
        now = time.monotonic()
        if now - self._pinged < self.ping_interval:
            return
        self._pinged = now
        try:
            self._push.send_multipart([self._rank, b""], zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._push.close()
