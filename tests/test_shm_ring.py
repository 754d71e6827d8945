"""The shared-memory broadcast ring: order, wrap-around, slow readers, big messages."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
import uuid

import pytest
import zmq

from aserve.distributed import shm_ring
from aserve.distributed.shm_ring import ShmRingReader, ShmRingWriter

CHUNKS, CHUNK_BYTES = 4, 4096


@pytest.fixture
def ring_names(tmp_path):
    token = uuid.uuid4().hex[:12]
    return f"aserve_test_{token}", f"ipc://{tmp_path}/side-{token}"


def make_writer(names, n_readers, ctx, chunks=CHUNKS, **kwargs):
    return ShmRingWriter(names[0], n_readers, side_channel_address=names[1], zmq_context=ctx,
                         max_chunks=chunks, max_chunk_bytes=CHUNK_BYTES, **kwargs)


def make_reader(names, rank, n_readers, ctx, chunks=CHUNKS):
    return ShmRingReader(names[0], rank, n_readers, side_channel_address=names[1], zmq_context=ctx,
                         max_chunks=chunks, max_chunk_bytes=CHUNK_BYTES)


def message(i: int) -> bytes:
    size = 10 * CHUNK_BYTES if i % 7 == 3 else (i * 37) % 3000  # some go through the side channel
    return hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)


def reader_process(names, rank, n_readers, count, conn):
    ctx = zmq.Context()
    reader = make_reader(names, rank, n_readers, ctx)
    conn.send("attached")
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(reader.read(timeout=30))
    reader.close()
    ctx.term()
    conn.send(digest.hexdigest())


def test_many_messages_in_order_to_several_reader_processes(ring_names):
    n_readers, count = 2, 200
    ctx = zmq.Context()
    writer = make_writer(ring_names, n_readers, ctx)
    spawn = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(n_readers):
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=reader_process, args=(ring_names, rank, n_readers, count, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        for pipe in pipes:
            assert pipe.poll(60) and pipe.recv() == "attached"
        writer.wait_for_readers(timeout=30)
        expected = hashlib.sha256()
        for i in range(count):  # 200 messages through 4 chunks: 50 wrap-arounds
            writer.write(message(i), timeout=30)
            expected.update(message(i))
        for pipe in pipes:
            assert pipe.poll(60)
            assert pipe.recv() == expected.hexdigest()
    finally:
        for proc in procs:
            proc.join(30)
        writer.close()
        ctx.term()
    assert all(p.exitcode == 0 for p in procs)
    assert not os.path.exists(f"/dev/shm/{ring_names[0]}")


def test_slow_reader_blocks_the_writer_until_it_reads(ring_names):
    ctx = zmq.Context()
    writer = make_writer(ring_names, 2, ctx)
    fast, slow = make_reader(ring_names, 0, 2, ctx), make_reader(ring_names, 1, 2, ctx)
    writer.wait_for_readers(timeout=10)
    try:
        for i in range(CHUNKS):
            writer.write(b"m%d" % i)
        assert [fast.read(timeout=1) for _ in range(CHUNKS)] == [b"m%d" % i for i in range(CHUNKS)]
        with pytest.raises(TimeoutError):
            writer.write(b"next", timeout=0.05)  # chunk 0 is still unread by the slow reader
        assert slow.read(timeout=1) == b"m0"
        writer.write(b"next", timeout=1)
        assert fast.read(timeout=1) == b"next"
        assert [slow.read(timeout=1) for _ in range(CHUNKS)] == [b"m1", b"m2", b"m3", b"next"]
    finally:
        fast.close()
        slow.close()
        writer.close()
        ctx.term()


def test_reader_times_out_when_nothing_comes(ring_names):
    ctx = zmq.Context()
    writer = make_writer(ring_names, 1, ctx)
    reader = make_reader(ring_names, 0, 1, ctx)
    try:
        with pytest.raises(TimeoutError):
            reader.read(timeout=0.05)
    finally:
        reader.close()
        writer.close()
        ctx.term()


def test_message_larger_than_a_chunk(ring_names):
    ctx = zmq.Context()
    writer = make_writer(ring_names, 1, ctx)
    reader = make_reader(ring_names, 0, 1, ctx)
    writer.wait_for_readers(timeout=10)
    try:
        big = os.urandom(5 * CHUNK_BYTES)
        writer.write(b"before")
        writer.write(big)
        writer.write(b"after")
        assert [reader.read(timeout=5) for _ in range(3)] == [b"before", big, b"after"]
    finally:
        reader.close()
        writer.close()
        ctx.term()


def test_blocked_writer_names_the_reader_behind(ring_names, caplog):
    ctx = zmq.Context()
    writer = make_writer(ring_names, 2, ctx, chunks=1, warn_after=0.05)
    fast, slow = make_reader(ring_names, 0, 2, ctx, chunks=1), make_reader(ring_names, 1, 2, ctx, chunks=1)
    writer.wait_for_readers(timeout=10)
    try:
        writer.write(b"one")
        assert fast.read(timeout=1) == b"one"
        with caplog.at_level("WARNING", logger="aserve.distributed.shm_ring"):
            with pytest.raises(TimeoutError):
                writer.write(b"two", timeout=0.3)
        assert "readers [1] have not read chunk 0" in caplog.text
    finally:
        fast.close()
        slow.close()
        writer.close()
        ctx.term()


def test_a_ring_appears_under_its_name_only_at_full_size(ring_names):
    """A reader polling for the name must never open a segment still being created (an
    empty file failed to map: a start-up race seen with the engine core attaching to a
    worker's response ring)."""
    from aserve.distributed.shm_ring import RingClosedError

    ctx = zmq.Context()
    with pytest.raises(RingClosedError):
        make_reader(ring_names, 0, 1, ctx)  # not created yet: the retryable error
    writer = make_writer(ring_names, 1, ctx)
    try:
        segment = f"/dev/shm/{ring_names[0]}"
        assert os.path.getsize(segment) == writer.layout.size
        assert [p for p in os.listdir("/dev/shm") if p.startswith(ring_names[0])] == [ring_names[0]]
        with pytest.raises(FileExistsError):  # the name is taken exclusively, as O_EXCL took it
            make_writer(ring_names, 1, ctx)
        assert [p for p in os.listdir("/dev/shm") if p.startswith(ring_names[0])] == [ring_names[0]]
        reader = make_reader(ring_names, 0, 1, ctx)
        writer.wait_for_readers(timeout=10)
        writer.write(b"hello")
        assert reader.read(timeout=10) == b"hello"
        reader.close()
    finally:
        writer.close()
        ctx.term()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(ring_names[0])]


def _thread_blocked_in_poll(tid: int) -> bool:
    # /proc/<tid>/syscall starts with the number of the system call a thread is blocked
    # in: 7 is poll on x86-64 (select.poll), 271 ppoll.
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split()[0] in ("7", "271")


@pytest.mark.parametrize("wake_every_write", [True, False])
def test_doorbell_wakes_a_deep_sleeping_reader(ring_names, wake_every_write, monkeypatch):
    """A reader blocked on its doorbell gets a message as soon as it is written, where
    without the doorbell it would sleep until its safety poll (set to a minute here). With
    wake_every_write off the writer rings only after an idle gap of WAKE_AFTER, so the
    test leaves that gap before each write."""
    monkeypatch.setattr(shm_ring, "DEEP_POLL_MS", 60_000)
    ctx = zmq.Context()
    writer = make_writer(ring_names, 1, ctx, wake_every_write=wake_every_write)
    reader = ShmRingReader(ring_names[0], 0, 1, side_channel_address=ring_names[1], zmq_context=ctx,
                           max_chunks=CHUNKS, max_chunk_bytes=CHUNK_BYTES, deep_sleep_after=0.0)
    writer.wait_for_readers(timeout=10)
    got, tids = [], []

    def read() -> None:
        tids.append(threading.get_native_id())
        got.append(reader.read())

    try:
        for i in range(2):
            tids.clear()
            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            while not tids or not _thread_blocked_in_poll(tids[0]):
                assert thread.is_alive(), "the reader returned before anything was written"
                time.sleep(0.001)  # polling the reader's state, not a wait for it
            while not wake_every_write and time.monotonic() - writer._last_write <= shm_ring.WAKE_AFTER:
                time.sleep(0.005)  # the writer's idle gap after which it rings
            writer.write(message(i))
            thread.join(timeout=5)
            assert not thread.is_alive() and got == [message(j) for j in range(i + 1)]
    finally:
        reader.close()
        writer.close()
        ctx.term()


def test_doorbell_leaves_no_file_and_tolerates_a_gone_reader(ring_names, tmp_path):
    """The doorbells live in the abstract namespace: nothing appears on disk, and a
    writer ringing for a reader that has closed carries on (the ring's own flags, not
    the doorbell, say who is behind)."""
    ctx = zmq.Context()
    writer = make_writer(ring_names, 1, ctx, wake_every_write=True)
    reader = make_reader(ring_names, 0, 1, ctx)
    writer.wait_for_readers(timeout=10)
    try:
        with open("/proc/net/unix") as f:
            bound = [line.split()[-1] for line in f if ring_names[0] in line]
        assert bound == [f"@aserve-ring/{ring_names[0]}/0"]
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(ring_names[1][len("ipc://"):])]
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            queue = int(f.read())
        for i in range(queue + 2):  # more rings than the doorbell's queue holds: the last drop
            writer.write(message(i))
            assert reader.read(timeout=5) == message(i)
        reader.close()
        writer.write(b"after the reader left")  # rings a doorbell nobody holds
    finally:
        writer.close()
        ctx.term()
