"""The data-parallel coordinator process (docs/design.md §1, §7): engines' load figures and waves.

::

    engine cores ── PUSH ──► PULL ─ collect task ─► CoordinatorLogic ─► publish task ─► XPUB ──► API servers' SUB
    engine cores ◄─ DEALER ─ ROUTER ◄── START_DP_WAVE (lockstep engines only)

Engines send (waiting, running, KV usage) when their counts change; the coordinator
publishes every engine's figures at most every 100 ms while they change and sleeps
while they do not (no timer runs when the server is idle). A new subscriber gets the
current figures at once, so an API server that starts late does not wait for the next
change. The logic (timing, waves) is ``CoordinatorLogic``; this module is its I/O.

The process imports neither torch nor the model code: it starts in a fraction of a second.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import sys
import time
from dataclasses import dataclass

import anyio
import msgspec
import zmq

from aserve.engine.coordinator_logic import CoordinatorLogic, Publication
from aserve.envs import read_env
from aserve.process.utils import exit_with_parent, ignore_termination, interrupt_on_termination, set_process_title
from aserve.wire.codec import DPLoads, RequestType, StartDPWave, WireError, decode_outputs
from aserve.wire.sockets import endpoint, open_socket
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.coordinator")


@dataclass(frozen=True)
class CoordinatorConfig:
    num_engines: int
    input_address: str  # ROUTER: engines' DEALERs connect
    stats_address: str  # PULL: engines' PUSHes connect
    publish_address: str  # XPUB: API servers' SUBs connect
    secret: bytes | None = None  # CURVE on tcp:// binds (multi-node)
    report: multiprocessing.connection.Connection | None = None  # gets the bound endpoints (tcp port 0)


def encode_publication(publication: Publication) -> bytes:
    loads = [(x.waiting, x.running, x.kv_cache_usage) for x in publication.loads]
    return msgspec.msgpack.encode(DPLoads(loads, publication.wave, publication.engines_running))


def run_coordinator(cfg: CoordinatorConfig) -> None:
    """Process entry point (a ``spawn`` target). Exits 0 on SIGTERM."""
    set_process_title("aserve::coordinator")
    exit_with_parent()
    interrupt_on_termination()
    logging.basicConfig(level=read_env().log_level,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    code = 0
    try:
        anyio.run(serve_coordinator, cfg)
    except KeyboardInterrupt:
        pass
    except BaseException:
        logger.exception("the coordinator failed")
        code = 1
    finally:
        ignore_termination()
    sys.exit(code)


async def serve_coordinator(cfg: CoordinatorConfig, *, clock=time.monotonic) -> None:
    ctx = zmq.Context()
    sockets: list[AsyncSocket] = []

    def bind(kind: int, address: str) -> AsyncSocket:
        sock = open_socket(ctx, kind, address, bind=True, secret=cfg.secret)
        sockets.append(sock)
        return sock

    try:
        router = bind(zmq.ROUTER, cfg.input_address)
        pull = bind(zmq.PULL, cfg.stats_address)
        xpub = bind(zmq.XPUB, cfg.publish_address)
        if cfg.report is not None:
            cfg.report.send([endpoint(s) for s in (router, pull, xpub)])
            cfg.report.close()
        logic = CoordinatorLogic(cfg.num_engines)
        changed = anyio.Event()

        async def collect() -> None:
            nonlocal changed
            while True:
                frames = await pull.recv_multipart()
                try:
                    outputs = decode_outputs(frames[0])
                except WireError as exc:
                    logger.warning("dropped a malformed message from an engine: %s", exc)
                    continue
                engine = outputs.engine_index
                if not 0 <= engine < cfg.num_engines:
                    logger.warning("dropped figures from unknown engine %d", engine)
                    continue
                if outputs.scheduler_stats is not None:
                    s = outputs.scheduler_stats
                    logic.on_engine_stats(engine, s.num_waiting, s.num_running, s.kv_cache_usage)
                if outputs.start_wave is not None:
                    start = logic.on_request_for_wave(outputs.start_wave, engine)
                    if start is not None:
                        body = msgspec.msgpack.encode(StartDPWave(*start))
                        for other in range(cfg.num_engines):
                            if other != start[1]:
                                # Not connected (yet): ROUTER drops it, as a late engine
                                # learns the wave from its next request anyway.
                                router.send_nowait([other.to_bytes(2, "little"), RequestType.START_DP_WAVE.value, body])
                if outputs.wave_complete is not None:
                    logic.on_wave_complete(outputs.wave_complete)
                changed.set()

        async def publish() -> None:
            nonlocal changed
            while True:
                due = logic.next_publish_in(clock())
                if due is None:
                    await changed.wait()  # idle: no timer at all
                    changed = anyio.Event()
                elif due > 0:
                    await anyio.sleep(due)
                else:
                    publication = logic.publish(clock())
                    if publication is not None:
                        xpub.send_nowait([encode_publication(publication)])

        async def welcome_subscribers() -> None:
            while True:
                frames = await xpub.recv_multipart()
                if frames and frames[0][:1] == b"\x01":  # a subscription: send the current figures now
                    xpub.send_nowait([encode_publication(Publication(tuple(logic.loads), logic.wave,
                                                                     logic.engines_running))])

        async def drain_router() -> None:
            while True:  # engines never send here; read so nothing piles up
                await router.recv_multipart()

        logger.info("coordinating %d engines (pid %d)", cfg.num_engines, os.getpid())
        async with anyio.create_task_group() as tg:
            for task in (collect, publish, welcome_subscribers, drain_router):
                tg.start_soon(task)
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
