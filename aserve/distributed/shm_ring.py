"""A lock-free broadcast ring in shared memory: one writer, N readers (wire 2).

The engine core writes each message once; every worker reads it. Layout of the one
segment (``/dev/shm/<name>``)::

    +---------------------------------------------+------------------------------------+
    | chunk 0 | chunk 1 | ...       | chunk C-1   | meta 0 | meta 1 | ... | meta C-1    |
    +---------------------------------------------+------------------------------------+
      C x max_chunk_bytes                           C x (1 + n_readers) bytes

    meta i  = [ written | read_0 | read_1 | ... | read_{N-1} ]    one byte each
    chunk i = [ kind: u8 | length: u32 | payload ]   kind 0: inline, 1: on the side channel

No locks: the writer is the only one to touch ``written`` and to clear read flags, and
each reader touches only its own flag. The writer reuses a chunk only when it is
unwritten or every reader has set its flag; a reader reads a chunk when ``written`` is
set and its own flag is clear. A write goes: clear ``written``, write the data, clear
the reader flags, set ``written``; a reader copies the payload out before it sets its
flag. (x86 keeps stores in order and loads in order, which is all this needs.)

A payload larger than a chunk goes through a ZeroMQ XPUB/SUB side channel, with a
marker in the chunk so readers take messages in order from the ring.

Waiting, in three stages: spin with ``sched_yield`` for 0.2 ms (during generation
messages arrive microseconds to milliseconds apart), then sleep with a growing
back-off up to 1 ms, then, after ``DEEP_SLEEP_AFTER`` (50 ms) of waiting, block on the
reader's doorbell with no CPU use at all. A writer whose previous write is more than
``WAKE_AFTER`` (20 ms) old also rings every reader's doorbell: any reader asleep that
deeply has waited at least 50 ms since its last message, so the writer's gap is at
least that long and the ring always reaches it. An idle server thus costs about one
wake-up a second per process (on this VM each wake-up is charged about 0.5 ms of CPU,
so their number, not their work, sets idle CPU). A wait past its timeout raises
``TimeoutError``; a writer blocked for ``warn_after`` seconds logs which readers have
not caught up.

The doorbell is a Unix datagram socket each reader binds in Linux's abstract namespace
(no file to clean up: the name goes with the socket), and a ring is one ``sendto`` of
one byte. It replaced a one-frame wake-up on the ZeroMQ side channel, which hands each
message to ZeroMQ's I/O thread on both ends: measured as a ping-pong between two
processes, 49 us of CPU per process and 115 us per round trip, against 4 us and 8 us
for the datagram. A full doorbell (a reader that has not slept since earlier rings)
drops the ring, which is then not needed.

The writer creates the segment and unlinks it in ``close()``; readers only attach.
Nothing read from the ring is unpickled: payloads are bytes (msgspec on both sides).
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 16 << 20
DEFAULT_MAX_CHUNKS = 8
_HEADER = struct.Struct("<BI")  # kind, length
_INLINE, _SIDE = 0, 1

SPIN_SECONDS = 2e-4  # yield-spin this long before sleeping
MAX_SLEEP_SECONDS = 1e-3  # longest back-off sleep before the deep sleep
DEEP_SLEEP_AFTER = 0.05  # readers then block on their doorbell
WAKE_AFTER = 0.02  # a write after this long an idle gap also rings the doorbells
DEEP_POLL_MS = 5000  # a deep-sleeping reader still looks at the ring this often (a safety net)
_DATA = b"D"


def _doorbell_address(ring_name: str, rank: int) -> str:
    """Reader ``rank``'s doorbell, in the abstract namespace (the leading NUL)."""
    return f"\0aserve-ring/{ring_name}/{rank}"


def _doorbell_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


class RingClosedError(RuntimeError):
    """The ring's segment is gone (its writer closed it)."""


def _wait(ready: Callable[[], bool], deadline: float | None, on_slow: Callable[[float], None] | None = None,
          warn_after: float = 60.0, deep_sleep: Callable[[float], None] | None = None,
          deep_sleep_after: float = DEEP_SLEEP_AFTER) -> None:
    """Return once ``ready()``; TimeoutError at ``deadline`` (a ``time.monotonic`` value).

    ``deep_sleep(seconds)`` blocks until woken or the time passes, from
    ``deep_sleep_after`` seconds into the wait; without it the back-off sleeps go on.
    With ``deep_sleep_after`` 0 there is no spin either (see ShmRingReader)."""
    if ready():
        return
    start = time.monotonic()
    spin_until = start + (SPIN_SECONDS if deep_sleep is None or deep_sleep_after > 0 else 0.0)
    while time.monotonic() < spin_until:
        os.sched_yield()
        if ready():
            return
    sleep = 1e-5
    next_warning = start + warn_after
    deep_from = start + deep_sleep_after
    while not ready():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError("timed out waiting on the shared-memory ring")
        if on_slow is not None and now >= next_warning:
            on_slow(now - start)
            next_warning = now + warn_after
        if deep_sleep is not None and now >= deep_from:
            limit = DEEP_POLL_MS / 1000 if deadline is None else min(DEEP_POLL_MS / 1000, deadline - now)
            deep_sleep(max(limit, 0.0))
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_SECONDS)


class _Segment:
    """A /dev/shm file mapped whole. ``create`` makes it under a temporary name, sizes
    it, and only then links it to ``name`` (failing if that exists): a reader polling
    for the name never opens a file that is still empty (it used to, now and then, and
    failed to map it)."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name
        self.path = f"/dev/shm/{name}"
        # The temporary name keeps the ring's prefix, so an instance's sweep of
        # /dev/shm/<instance>_* also finds one left by a process killed in between.
        path = f"{self.path}.{os.getpid()}.creating" if create else self.path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
            if create:
                os.link(path, self.path)  # FileExistsError, as O_EXCL gave before
        finally:
            os.close(fd)
            if create:
                os.unlink(path)
        self.buf = memoryview(self.map)

    def close(self) -> None:
        self.buf.release()
        self.map.close()


class _Layout:
    def __init__(self, n_readers: int, max_chunks: int, max_chunk_bytes: int) -> None:
        self.n_readers = n_readers
        self.max_chunks = max_chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.meta_start = max_chunks * max_chunk_bytes
        self.meta_stride = 1 + n_readers
        self.size = self.meta_start + max_chunks * self.meta_stride

    def chunk(self, i: int) -> int:
        return i * self.max_chunk_bytes

    def meta(self, i: int) -> int:
        return self.meta_start + i * self.meta_stride


class ShmRingWriter:
    """The writing end; creates the segment and the side channel.

    ``side_channel_address`` is where the XPUB socket binds (``ipc://...``); call
    :meth:`wait_for_readers` before the first write so no side-channel message is lost.
    ``wake_every_write`` rings the readers' doorbells after every write, not only after
    an idle gap: for a ring whose reader sleeps from the start of each wait (a
    worker's response ring: the engine core then sleeps through the model step instead
    of waking up to 20 times to look).
    """

    def __init__(self, name: str, n_readers: int, *, side_channel_address: str, zmq_context: zmq.Context,
                 max_chunks: int = DEFAULT_MAX_CHUNKS, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 warn_after: float = 60.0, wake_every_write: bool = False) -> None:
        self.layout = _Layout(n_readers, max_chunks, max_chunk_bytes)
        self._segment = _Segment(name, self.layout.size, create=True)
        self.name = name
        self.side_channel_address = side_channel_address
        self._side = zmq_context.socket(zmq.XPUB)
        self._side.setsockopt(zmq.LINGER, 0)
        self._side.setsockopt(zmq.SNDHWM, 0)
        # Report every reader's subscription, not only the first one to a topic.
        self._side.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._side.bind(side_channel_address)
        self._index = 0
        self._warn_after = warn_after
        self._closed = False
        self._last_write = time.monotonic()
        self._wake_every_write = wake_every_write
        self._doorbell = _doorbell_socket()
        self._doorbells = [_doorbell_address(name, rank) for rank in range(n_readers)]

    def wait_for_readers(self, timeout: float) -> None:
        """Block until every reader has subscribed to the side channel."""
        deadline = time.monotonic() + timeout
        subscribed = 0
        poller = zmq.Poller()
        poller.register(self._side, zmq.POLLIN)
        while subscribed < self.layout.n_readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError(f"{subscribed} of {self.layout.n_readers} ring readers attached")
            if self._side.recv()[:1] == b"\x01":
                subscribed += 1

    def _behind(self, meta: int) -> list[int]:
        buf = self._segment.buf
        return [r for r in range(self.layout.n_readers) if not buf[meta + 1 + r]]

    def write(self, payload: bytes, timeout: float | None = None) -> None:
        """Publish ``payload`` to every reader; waits while the chunk is still unread."""
        buf = self._segment.buf
        layout = self.layout
        meta = layout.meta(self._index)
        readers = range(1, 1 + layout.n_readers)

        def chunk_free() -> bool:
            return not buf[meta] or all(buf[meta + r] for r in readers)

        def log_slow(waited: float) -> None:
            logger.warning("ring %s: writer blocked for %.0f s; readers %s have not read chunk %d",
                           self.name, waited, self._behind(meta), self._index)

        _wait(chunk_free, None if timeout is None else time.monotonic() + timeout, log_slow, self._warn_after)
        start = layout.chunk(self._index)
        buf[meta] = 0
        if _HEADER.size + len(payload) <= layout.max_chunk_bytes:
            _HEADER.pack_into(buf, start, _INLINE, len(payload))
            buf[start + _HEADER.size : start + _HEADER.size + len(payload)] = payload
        else:
            _HEADER.pack_into(buf, start, _SIDE, len(payload))
            self._side.send_multipart([_DATA, payload], copy=False)
        buf[meta + 1 : meta + 1 + layout.n_readers] = bytes(layout.n_readers)
        buf[meta] = 1
        self._index = (self._index + 1) % layout.max_chunks
        now = time.monotonic()
        if self._wake_every_write or now - self._last_write > WAKE_AFTER:
            self._ring_doorbells()
        self._last_write = now

    def _ring_doorbells(self) -> None:
        for address in self._doorbells:
            try:
                self._doorbell.sendto(b"W", address)
            except BlockingIOError:
                pass  # its queue is full of earlier rings: it wakes anyway
            except ConnectionRefusedError:
                pass  # no reader bound there (not attached yet, or gone): none asleep

    def close(self) -> None:
        """Close the side channel and unmap and unlink the segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._side.close(linger=0)
        self._doorbell.close()
        self._segment.close()
        try:
            os.unlink(self._segment.path)
        except FileNotFoundError:
            pass


class ShmRingReader:
    """Reader ``rank`` of an existing ring (0 .. n_readers - 1).

    ``deep_sleep_after``: seconds of waiting after which the reader blocks on its
    doorbell; 0 only for a ring whose writer rings it after every write
    (``wake_every_write``), and then without the spin before: the engine core waiting on
    a worker's reply spun 0.2 ms a step on the cores the API server needs, for a wake-up
    the doorbell now gives in microseconds. The doorbell is bound before the side channel
    subscribes, so a writer past ``wait_for_readers`` can always ring it."""

    def __init__(self, name: str, rank: int, n_readers: int, *, side_channel_address: str, zmq_context: zmq.Context,
                 max_chunks: int = DEFAULT_MAX_CHUNKS, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 deep_sleep_after: float = DEEP_SLEEP_AFTER) -> None:
        self.layout = _Layout(n_readers, max_chunks, max_chunk_bytes)
        self.rank = rank
        try:
            self._segment = _Segment(name, self.layout.size, create=False)
        except FileNotFoundError as exc:
            raise RingClosedError(f"ring segment {name} does not exist") from exc
        self._doorbell = _doorbell_socket()
        self._doorbell.bind(_doorbell_address(name, rank))
        self._poll = select.poll()
        self._poll.register(self._doorbell.fileno(), select.POLLIN)
        self._side = zmq_context.socket(zmq.SUB)
        self._side.setsockopt(zmq.LINGER, 0)
        self._side.setsockopt(zmq.RCVHWM, 0)
        self._side.setsockopt(zmq.SUBSCRIBE, b"")
        self._side.connect(side_channel_address)
        self._index = 0
        self._deep_sleep_after = deep_sleep_after

    def _deep_sleep(self, seconds: float) -> None:
        """Block until the doorbell rings or ``seconds`` pass; empty it."""
        if self._poll.poll(int(seconds * 1000)):
            try:
                while True:
                    self._doorbell.recv(64)
            except BlockingIOError:
                pass

    def _side_payload(self) -> bytes:
        return self._side.recv_multipart()[1]

    def read(self, timeout: float | None = None, on_idle: Callable[[], None] | None = None) -> bytes:
        """The next message; waits for it (TimeoutError after ``timeout`` seconds).

        ``on_idle()`` runs each time a deep sleep wakes (at least every DEEP_POLL_MS), so
        a caller can do periodic work, such as a heartbeat, without a thread of its own."""
        buf = self._segment.buf
        layout = self.layout
        meta = layout.meta(self._index)
        flag = meta + 1 + self.rank
        deep_sleep = self._deep_sleep
        if on_idle is not None:
            def deep_sleep(seconds: float) -> None:
                on_idle()
                self._deep_sleep(seconds)
        _wait(lambda: buf[meta] == 1 and not buf[flag], None if timeout is None else time.monotonic() + timeout,
              deep_sleep=deep_sleep, deep_sleep_after=self._deep_sleep_after)
        start = layout.chunk(self._index)
        kind, length = _HEADER.unpack_from(buf, start)
        if kind == _INLINE:
            payload = bytes(buf[start + _HEADER.size : start + _HEADER.size + length])
        else:
            payload = self._side_payload()
        buf[flag] = 1
        self._index = (self._index + 1) % layout.max_chunks
        return payload

    def close(self) -> None:
        self._side.close(linger=0)
        self._doorbell.close()
        self._segment.close()
