"""The DP coordinator over real ZeroMQ sockets, under asyncio and Trio: engines' figures
in, publications out, a new subscriber welcomed with the current figures, START_DP_WAVE
to every engine but the one that asked."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import zmq

from aserve.engine.coordinator import CoordinatorConfig, serve_coordinator
from aserve.wire.codec import DPLoads, RequestDecoder, RequestType
from aserve.wire.messages import EngineCoreOutputs, SchedulerStats
from aserve.wire.zmq_anyio import AsyncSocket

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def _next_loads(sub: AsyncSocket, until) -> tuple[DPLoads, int]:
    """Publications up to the first that satisfies ``until``; (it, how many were read)."""
    count = 0
    with anyio.fail_after(10):
        while True:
            loads = msgspec.msgpack.decode((await sub.recv_multipart())[0], type=DPLoads)
            count += 1
            if until(loads):
                return loads, count


async def test_figures_are_published_and_waves_reach_the_other_engines(tmp_path):
    cfg = CoordinatorConfig(2, f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/stats", f"ipc://{tmp_path}/publish")
    ctx = zmq.Context()
    sockets = []

    def connect(kind: int, address: str, identity: bytes | None = None) -> AsyncSocket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        sockets.append(AsyncSocket(sock))
        return sockets[-1]

    def stats(engine: int, waiting: int, running: int, **extra) -> list[bytes]:
        out = EngineCoreOutputs(engine, scheduler_stats=SchedulerStats(running, waiting, 0.25), **extra)
        return [msgspec.msgpack.encode(out)]

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_coordinator, cfg)
            push = connect(zmq.PUSH, cfg.stats_address)
            engines = [connect(zmq.DEALER, cfg.input_address, rank.to_bytes(2, "little")) for rank in range(2)]
            for engine in engines:  # make the ROUTER learn both identities
                await engine.send_multipart([b"READY", b""])

            sub = connect(zmq.SUB, cfg.publish_address)
            # A new subscriber gets the current figures at once: nothing has changed yet.
            first, _ = await _next_loads(sub, lambda x: True)
            assert first.loads == [(0, 0, 0.0), (0, 0, 0.0)] and first.wave == 0 and not first.engines_running

            await push.send_multipart(stats(0, waiting=2, running=1))
            loads, _ = await _next_loads(sub, lambda x: x.loads[0] != (0, 0, 0.0))
            assert loads.loads == [(2, 1, 0.25), (0, 0, 0.0)]

            # Five changes at once are coalesced: published at most every 100 ms.
            for waiting in range(3, 8):
                await push.send_multipart(stats(1, waiting=waiting, running=0))
            loads, count = await _next_loads(sub, lambda x: x.loads[1][0] == 7)
            assert loads.loads == [(2, 1, 0.25), (7, 0, 0.25)] and count <= 2

            # A request for wave 0 reached paused engine 0: engine 1 (only) is told to start it.
            await push.send_multipart([msgspec.msgpack.encode(EngineCoreOutputs(0, start_wave=0))])
            with anyio.fail_after(10):
                frames = await engines[1].recv_multipart()
            kind, body = RequestDecoder().decode(frames)
            assert kind is RequestType.START_DP_WAVE and (body.wave, body.exclude_engine_index) == (0, 0)
            loads, _ = await _next_loads(sub, lambda x: x.engines_running)
            assert loads.wave == 0
            assert engines[0].socket.poll(0) == 0  # the engine that got the request is not told

            await push.send_multipart([msgspec.msgpack.encode(EngineCoreOutputs(1, wave_complete=0))])
            loads, _ = await _next_loads(sub, lambda x: not x.engines_running)
            assert loads.wave == 1

            # A malformed message is dropped; the coordinator keeps serving.
            await push.send_multipart([b"\xc1garbage"])
            await push.send_multipart(stats(0, waiting=0, running=0))
            loads, _ = await _next_loads(sub, lambda x: x.loads[0] == (0, 0, 0.25))
            tg.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
