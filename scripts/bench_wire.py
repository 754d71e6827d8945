#!/usr/bin/env python3
"""Messages per second over wire 1 (ZeroMQ + msgpack), under asyncio and Trio.

    python scripts/bench_wire.py [--messages 20000] [--window 64]

A client process (ROUTER + PULL, through aserve's anyio adapter) sends ADD requests
(an ``EngineCoreRequest`` with a 128-token prompt) to an echo engine process (DEALER +
PUSH, plain blocking pyzmq), which decodes each one and answers with an
``EngineCoreOutputs`` holding one token; at most ``--window`` requests are in flight.
Prints round trips per second (each is one request message and one output message).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time

import anyio
import zmq

from aserve.sampling_params import SamplingParams
from aserve.wire.codec import OutputsEncoder, RequestDecoder, RequestEncoder, RequestType, decode_outputs
from aserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from aserve.wire.zmq_anyio import AsyncSocket


def echo_engine(input_address: str, output_address: str, count: int) -> None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, (0).to_bytes(2, "little"))
    dealer.connect(input_address)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_address)
    dealer.send_multipart([b"READY", b""])
    decoder, encoder = RequestDecoder(), OutputsEncoder()
    for _ in range(count):
        _, request = decoder.decode(dealer.recv_multipart())
        push.send(encoder.encode(EngineCoreOutputs(0, [EngineCoreOutput(request.request_id, [7])])), copy=True)
    dealer.close(linger=1000)
    push.close(linger=1000)
    ctx.term()


async def client(tmp: str, count: int, window: int) -> float:
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    router.bind(f"ipc://{tmp}/in")
    pull.bind(f"ipc://{tmp}/out")
    proc = mp.get_context("spawn").Process(target=echo_engine, args=(f"ipc://{tmp}/in", f"ipc://{tmp}/out", count))
    proc.start()
    r, p = AsyncSocket(router), AsyncSocket(pull)
    identity = (await r.recv_multipart())[0]
    encoder = RequestEncoder()
    params = SamplingParams(max_tokens=16)
    credit = anyio.Semaphore(window)
    start = time.perf_counter()

    async def sender() -> None:
        for i in range(count):
            await credit.acquire()
            request = EngineCoreRequest(f"req-{i}", list(range(128)), params, arrival_time=time.monotonic())
            r.send_nowait([identity, *encoder.encode(RequestType.ADD, request)])
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sender)
        for _ in range(count):
            decode_outputs((await p.recv_multipart())[0])
            credit.release()
    elapsed = time.perf_counter() - start
    proc.join()
    r.close()
    p.close()
    ctx.term()
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    for backend in ("asyncio", "trio"):
        with tempfile.TemporaryDirectory() as tmp:
            rate = anyio.run(client, tmp, args.messages, args.window, backend=backend)
        print(f"{backend:<8} {rate:>9.0f} round trips/s ({args.messages} requests, window {args.window})")
        print(json.dumps({"backend": backend, "round_trips_per_s": round(rate)}))


if __name__ == "__main__":
    main()
