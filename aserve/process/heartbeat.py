"""Heartbeats in shared memory: liveness beyond exit codes (docs/design.md §9).

A process can hang without dying (stopped, deadlocked, a wedged device). Each engine
core and worker owns one 8-byte counter in a per-instance segment
(``/dev/shm/<instance>_heartbeat``); whoever watches the engine reads the counters and
treats a process whose counter has not moved for ``timeout`` seconds as dead, exactly
as if it had exited.

Who ticks: every engine core and worker, from a small thread of its own, once a second
(``INTERVAL``), from the moment the process starts (before its model loads) to its end.
The thread needs no GIL-free moment longer than a second: torch's kernels and aserve's C
kernels release the GIL, so a long prefill still ticks, and a process that SIGSTOP,
a debugger or a frozen VM halts stops ticking at once. The watcher checks every second
and the default timeout is 4 s, so a stopped process is reported within about 5 s
(``docs/design.md`` §14). A process that still ticks but makes no progress (a deadlock
in a collective) is the step bound's to find (``HealthConfig.step_bound``). The ticks
cost an idle server little: one wake-up a second per engine process (measured in
``docs/performance.md``).

Progress: beside its tick counter each slot has a second counter that a worker's model
thread advances after every layer of a step run layer by layer (:class:`Progress`). A
step that keeps advancing it is slow, not stuck: the step bound counts from the last
advance (``aserve.executor.multiproc``), so an 8k-token prefill on a slow CPU is served
however long it takes, while a deadlock, which advances nothing, still fails the engine
after the bound. Each counter has one writer (the heartbeat thread, or the model thread).

Layout: ``num_slots`` slots of two little-endian uint64 counters (ticks, then
progress). Slot of engine ``d`` with TP size ``t``: ``d * (1 + t)``; of its worker at TP
rank ``r``: ``d * (1 + t) + 1 + r``.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

INTERVAL = 1.0  # a tick a second: a stopped process is seen within timeout + 1 s
DEFAULT_TIMEOUT = 4.0
_COUNTER = struct.Struct("<Q")
_STRIDE = 2 * _COUNTER.size  # a slot: its ticks, then its progress


def segment_name(instance_id: str) -> str:
    return f"{instance_id}_heartbeat"


def engine_slot(dp_rank: int, world_size: int) -> int:
    """An engine core's slot; ``world_size``: the workers of each engine (TP x PP)."""
    return dp_rank * (1 + world_size)


def worker_slot(dp_rank: int, world_size: int, rank: int) -> int:
    """Worker ``rank`` (of ``world_size``) of engine ``dp_rank``'s slot."""
    return dp_rank * (1 + world_size) + 1 + rank


def create_segment(name: str, num_slots: int) -> None:
    """Create the zeroed counters for processes that others will watch; the creator
    removes the file (``cleanup_instance`` does, by the instance's prefix)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, num_slots * _STRIDE)
    finally:
        os.close(fd)


class HeartbeatTable:
    """The counters; ``create=True`` by the instance's owner, which also unlinks it."""

    def __init__(self, name: str, num_slots: int, *, create: bool) -> None:
        self.path = f"/dev/shm/{name}"
        self.num_slots = num_slots
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, num_slots * _STRIDE)
            self._map = mmap.mmap(fd, num_slots * _STRIDE)
        finally:
            os.close(fd)
        self._owner = create

    def read(self, slot: int) -> int:
        """The slot's tick counter."""
        return _COUNTER.unpack_from(self._map, slot * _STRIDE)[0]

    def tick(self, slot: int) -> None:
        _COUNTER.pack_into(self._map, slot * _STRIDE, (self.read(slot) + 1) & 0xFFFF_FFFF_FFFF_FFFF)

    def progress(self, slot: int) -> int:
        """The slot's progress counter (layers its process has run)."""
        return _COUNTER.unpack_from(self._map, slot * _STRIDE + _COUNTER.size)[0]

    def set_progress(self, slot: int, value: int) -> None:
        _COUNTER.pack_into(self._map, slot * _STRIDE + _COUNTER.size, value & 0xFFFF_FFFF_FFFF_FFFF)

    def close(self) -> None:
        self._map.close()
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class Heartbeat:
    """Ticks one slot from a thread while the ``with`` block runs; the thread is joined
    on exit, so it never outlives its owner."""

    def __init__(self, table: HeartbeatTable, slot: int, interval: float = INTERVAL) -> None:
        self.table, self.slot, self.interval = table, slot, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{slot}")

    def _run(self) -> None:
        while True:
            self.table.tick(self.slot)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


class Progress:
    """A worker's progress counter: ``advance()`` after each unit of a step's work (a
    layer), from the model's thread, the counter's only writer. It costs one 8-byte store
    into shared memory."""

    def __init__(self, table: HeartbeatTable, slot: int) -> None:
        self.table, self.slot = table, slot
        self.count = table.progress(slot)

    def advance(self) -> None:
        self.count += 1
        self.table.set_progress(self.slot, self.count)


class HeartbeatMonitor:
    """Finds slots whose counters stopped moving. ``check(now)`` returns the stale ones.
    A counter still at zero belongs to a process that has not started ticking yet (it is
    importing torch): it is not stale; the start-up timeout covers one that never starts."""

    def __init__(self, table: HeartbeatTable, slots: dict[int, str], timeout: float = DEFAULT_TIMEOUT) -> None:
        self.table, self.slots, self.timeout = table, slots, timeout
        now = time.monotonic()
        self._seen = {slot: (table.read(slot), now) for slot in slots}

    def check(self, now: float) -> list[str]:
        stale = []
        for slot, name in self.slots.items():
            value = self.table.read(slot)
            last_value, since = self._seen[slot]
            if value != last_value:
                self._seen[slot] = (value, now)
            elif value and now - since >= self.timeout:
                stale.append(name)
        return stale
