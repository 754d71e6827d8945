"""A remote worker's progress pings (``aserve.distributed.remote_workers``): sent on its
reply socket at most once per interval as its layers finish, told apart from replies by
the head and counted, over a real ZeroMQ TCP connection."""

from __future__ import annotations

import time

import zmq

from aserve.distributed.remote_workers import RemoteWorkers, ReplyPusher, reply_address
from tests.e2e.server import free_ports


def test_pings_are_counted_apart_from_replies_and_at_most_one_an_interval():
    ctx = zmq.Context()
    port = free_ports(3)
    head = RemoteWorkers(ctx, master_addr="127.0.0.1", master_port=port, ranks=[1, 2], secret=None)
    every_layer = ReplyPusher(ctx, reply_address("127.0.0.1", port), 1, None, ping_interval=0.0)
    rarely = ReplyPusher(ctx, reply_address("127.0.0.1", port), 2, None, ping_interval=3600.0)
    try:
        assert head.progress() == 0
        every_layer.write(b"first")
        every_layer.layer_done()
        every_layer.layer_done()
        rarely.layer_done()  # within its interval of its start: no ping
        rarely.layer_done()
        rarely.write(b"rarely's")
        every_layer.write(b"second")
        # Each connection keeps its order: once a pusher's last reply is read, every ping
        # it sent before that reply has been taken (and counted) too.
        assert head.read(1, timeout=10) == b"first"
        assert head.read(1, timeout=10) == b"second"
        assert head.read(2, timeout=10) == b"rarely's"
        assert head.progress() == 2
        # Pings taken while the head waits for no reply (its once-a-second look): a reply
        # taken with them waits in its rank's queue for the next read.
        every_layer.layer_done()
        every_layer.write(b"third")
        every_layer.layer_done()
        deadline = time.monotonic() + 10
        while head.progress() < 4 and time.monotonic() < deadline:
            pass  # the frames are on their way over TCP; progress() never blocks
        assert head.progress() == 4
        assert head.read(1, timeout=0) == b"third"
    finally:
        every_layer.close()
        rarely.close()
        head.close()
        ctx.term()
