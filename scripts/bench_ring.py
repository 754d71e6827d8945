#!/usr/bin/env python3
"""Broadcast latency to 2 readers: aserve's shared-memory ring against
``torch.distributed.broadcast_object_list`` over gloo, and against the path to workers on
other nodes (``aserve.distributed.remote_workers``: a CURVE-authenticated ZeroMQ PUB over
TCP, here over loopback, acknowledged on the PUSH/PULL reply wire), side by side.

    python scripts/bench_ring.py [--rounds 300] [--readers 2]

Each round the writer sends one payload (1 KB, then 1 MB) stamped with
``time.perf_counter_ns()`` (CLOCK_MONOTONIC, shared by all processes); each reader
records receive time minus stamp, then acknowledges, so rounds do not queue. Prints
p50/p99 in microseconds for both transports and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import struct
import tempfile
import time
import uuid

SIZES = {"1KB": 1 << 10, "1MB": 1 << 20}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- aserve ring -----------------------------------------------------------------------

def ring_reader(name: str, side: str, rank: int, n: int, rounds: int, ack_name: str, ack_side: str, out) -> None:
    import zmq

    from aserve.distributed.shm_ring import ShmRingReader, ShmRingWriter

    ctx = zmq.Context()
    reader = ShmRingReader(name, rank, n, side_channel_address=side, zmq_context=ctx)
    ack = ShmRingWriter(ack_name, 1, side_channel_address=ack_side, zmq_context=ctx, max_chunk_bytes=1 << 12)
    ack.wait_for_readers(60)
    latencies = []
    for _ in range(rounds):
        payload = reader.read(timeout=60)
        latencies.append((time.perf_counter_ns() - struct.unpack_from("<q", payload)[0]) / 1000)
        ack.write(b"k")
    out.send(latencies)
    reader.close()
    ack.close()
    ctx.term()


def bench_ring(size: int, rounds: int, n: int, tmp: str) -> list[float]:
    import zmq

    from aserve.distributed.shm_ring import ShmRingReader, ShmRingWriter

    ctx = zmq.Context()
    token = uuid.uuid4().hex[:8]
    name, side = f"aserve_bench_{token}", f"ipc://{tmp}/side-{token}"
    writer = ShmRingWriter(name, n, side_channel_address=side, zmq_context=ctx)
    spawn = mp.get_context("spawn")
    pipes, procs, acks = [], [], []
    for rank in range(n):
        parent, child = spawn.Pipe()
        ack_name, ack_side = f"{name}_ack{rank}", f"ipc://{tmp}/ack-{token}-{rank}"
        proc = spawn.Process(target=ring_reader, args=(name, side, rank, n, rounds, ack_name, ack_side, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
        acks.append((ack_name, ack_side))
    readers = []
    for ack_name, ack_side in acks:
        while True:
            try:
                readers.append(ShmRingReader(ack_name, 0, 1, side_channel_address=ack_side, zmq_context=ctx,
                                             max_chunk_bytes=1 << 12))
                break
            except Exception:
                time.sleep(0.01)
    writer.wait_for_readers(60)
    body = bytearray(size)
    for _ in range(rounds):
        struct.pack_into("<q", body, 0, time.perf_counter_ns())
        writer.write(bytes(body))
        for r in readers:
            r.read(timeout=60)
    latencies = [x for p in pipes for x in p.recv()]
    for proc in procs:
        proc.join()
    for r in readers:
        r.close()
    writer.close()
    ctx.term()
    return latencies


# -- the remote workers' wires ---------------------------------------------------------

SECRET = b"bench-secret-of-sixteen-bytes-or-more"


def remote_reader(port: int, rank: int, rounds: int, out) -> None:
    import zmq

    from aserve.distributed.remote_workers import CallSubscriber, ReplyPusher, call_address, reply_address

    ctx = zmq.Context()
    sub = CallSubscriber(ctx, call_address("127.0.0.1", port), SECRET)
    push = ReplyPusher(ctx, reply_address("127.0.0.1", port), rank, SECRET)
    sub.wait_connected(60)
    sub.read()  # the first probe: subscribed (a PUB drops what it sends before that)
    push.write(b"ready")
    latencies = []
    for _ in range(rounds):
        payload = sub.read()
        while payload == b"probe":
            payload = sub.read()
        latencies.append((time.perf_counter_ns() - struct.unpack_from("<q", payload)[0]) / 1000)
        push.write(b"k")
    out.send(latencies)
    sub.close()
    push.close()
    ctx.term()


def bench_remote(size: int, rounds: int, n: int) -> list[float]:
    import socket

    import zmq

    from aserve.distributed.remote_workers import RemoteWorkers

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = zmq.Context()
    head = RemoteWorkers(ctx, master_addr="127.0.0.1", master_port=port, ranks=list(range(n)), secret=SECRET)
    spawn = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(n):
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=remote_reader, args=(port, rank, rounds, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    ready: set[int] = set()
    while len(ready) < n:  # publish probes until every reader has seen one
        head.publish(b"probe")
        for rank in range(n):
            if rank not in ready:
                try:
                    head.read(rank, 0.01)
                    ready.add(rank)
                except TimeoutError:
                    pass
    body = bytearray(size)
    for _ in range(rounds):
        struct.pack_into("<q", body, 0, time.perf_counter_ns())
        head.publish(bytes(body))
        for rank in range(n):
            while head.read(rank, 60) == b"ready":  # a late answer to a probe
                pass
    latencies = [x for p in pipes for x in p.recv()]
    for proc in procs:
        proc.join()
    head.close()
    ctx.term()
    return latencies


# -- gloo ------------------------------------------------------------------------------

def gloo_rank(rank: int, world: int, init: str, size: int, rounds: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    latencies = []
    body = bytearray(size)
    for _ in range(rounds):
        objs = [None]
        if rank == 0:
            struct.pack_into("<q", body, 0, time.perf_counter_ns())
            objs = [bytes(body)]
        dist.broadcast_object_list(objs, src=0)
        if rank != 0:
            latencies.append((time.perf_counter_ns() - struct.unpack_from("<q", objs[0])[0]) / 1000)
        dist.barrier()  # the acknowledgement
    if rank != 0:
        out.send(latencies)
    dist.destroy_process_group()


def bench_gloo(size: int, rounds: int, n: int, tmp: str) -> list[float]:
    spawn = mp.get_context("spawn")
    init = f"file://{tmp}/gloo-{uuid.uuid4().hex[:8]}"
    pipes, procs = [], []
    for rank in range(n + 1):
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=gloo_rank, args=(rank, n + 1, init, size, rounds, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    latencies = [x for p in pipes[1:] for x in p.recv()]
    for proc in procs:
        proc.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--readers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'payload':<8} {'transport':<28} {'p50 us':>9} {'p99 us':>9}")
        for label, size in SIZES.items():
            ring = bench_ring(size, args.rounds, args.readers, tmp)
            gloo = bench_gloo(size, args.rounds, args.readers, tmp)
            remote = bench_remote(size, args.rounds, args.readers)
            for name, lat in (("aserve shm ring", ring), ("gloo broadcast_object_list", gloo),
                              ("remote workers' ZeroMQ (TCP)", remote)):
                print(f"{label:<8} {name:<28} {percentile(lat, .5):>9.0f} {percentile(lat, .99):>9.0f}")
            print(json.dumps({"payload": label, "ring_p50_us": round(percentile(ring, .5)),
                              "ring_p99_us": round(percentile(ring, .99)), "gloo_p50_us": round(percentile(gloo, .5)),
                              "gloo_p99_us": round(percentile(gloo, .99)),
                              "remote_p50_us": round(percentile(remote, .5)),
                              "remote_p99_us": round(percentile(remote, .99)),
                              "p50_speedup": round(percentile(gloo, .5) / percentile(ring, .5), 1)}))


if __name__ == "__main__":
    main()
