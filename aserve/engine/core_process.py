"""The engine-core process: an ``EngineCore`` wired to ZeroMQ (docs/design.md, sections 2 and 4).

::

    API server ROUTER ──► DEALER ─ input task ─┬─► input queue ──┐
                                               └─► aborts queue ─┤
                                                  busy loop (its own thread):
                                                  take input, schedule, execute, update,
                                                  drain aborts right after the step
    API server PULL ◄── PUSH ── output task ◄── output stream ◄──┘

The input and output tasks run in the process's anyio event loop; the busy loop runs
in a worker thread because a model step blocks. Only the busy loop changes the
``EngineCore``'s state; the input task calls its ``prepare_request``, which reads only
the fitted config (the length limit, the block size) to validate a request and hash its
prompt's blocks, so that work overlaps the step in flight. Every exit path sends ``ENGINE_CORE_DEAD`` to every API server as the
engine's last message (so their requests fail at once, even across machines), closes
the sockets and shuts the executor down (which removes its shared memory).

With a DP coordinator, the busy loop also sends the engine's (waiting, running, KV
usage) to it (client index -1) whenever the counts change.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from aserve.config import EngineConfig
from aserve.engine.engine_core import EngineCore
from aserve.engine.fit import FittedConfig
from aserve.envs import read_env
from aserve.errors import AserveError, EngineDeadError
from aserve.process.heartbeat import Heartbeat, HeartbeatTable, engine_slot
from aserve.process.instance import Instance
from aserve.process.utils import (
    exit_with_parent,
    ignore_termination,
    interrupt_on_termination,
    pin_to_cpus,
    request_short_slice,
    set_process_title,
)
from aserve.wire.codec import (
    ENGINE_CORE_DEAD,
    EngineReady,
    OutputsEncoder,
    RequestDecoder,
    RequestType,
    WireError,
)
from aserve.wire.messages import (
    SLEEPING,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
)
from aserve.wire.sockets import open_socket
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.engine_core")

READY_FRAME = b"READY"
#: The client index of the DP coordinator (load figures go to client -1).
COORDINATOR = -1

#: Engine-core methods a UTILITY call may name. Nothing else is callable from the wire.
UTILITY_METHODS = frozenset({"reset_prefix_cache", "get_stats", "ping", "sleep", "wake_up", "is_sleeping",
                             "start_profile", "stop_profile"})


@dataclass(frozen=True)
class EngineCoreProcConfig:
    fitted: FittedConfig  # fitted by whoever started the engine; never fitted again here
    engine_index: int
    input_addresses: tuple[str, ...]  # each API server's ROUTER
    output_addresses: tuple[str, ...]  # each API server's PULL
    instance: Instance  # this server instance's names (shared memory, IPC files)
    heartbeat_name: str | None = None  # the instance's heartbeat segment (see aserve.process.heartbeat)
    coordinator_input: str | None = None  # the DP coordinator's ROUTER (START_DP_WAVE); None: no coordinator
    coordinator_stats: str | None = None  # the DP coordinator's PULL: load figures go there (client index -1)
    secret: bytes | None = None  # CURVE for tcp:// addresses (see aserve.wire.auth)


#: The engine core's scheduler slice (Linux's default is 0.7 ms x (1 + log2 cores)). 7M
#: bf16 server, 32 streams, its front end sharing one core with the load generator:
#: 9,199, 9,432, 9,711 -> 10,447, 10,023, 10,032 tok/s (alternating with the default);
#: the 152M server (two worker threads on both cores) unchanged (docs/performance.md).
ENGINE_CORE_SLICE_NS = 100_000


def run_engine_core(cfg: EngineCoreProcConfig) -> None:
    """Process entry point (a ``spawn`` target)."""
    parent = os.getppid()
    set_process_title(f"aserve::engine_core_{cfg.engine_index}")
    pin_to_cpus(cfg.fitted.config.parallel.frontend_cpus(), all_threads=True)  # off the workers' cores
    interrupt_on_termination()  # until the busy loop exists: interrupts start-up, cleanly
    exit_with_parent()
    logging.basicConfig(level=read_env().log_level,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    code = 0
    heartbeat = table = None
    if cfg.heartbeat_name is not None:
        world = cfg.fitted.config.parallel.world_size  # the engine's workers
        table = HeartbeatTable(cfg.heartbeat_name, engine_slot(cfg.engine_index, world) + 1 + world, create=False)
        heartbeat = Heartbeat(table, engine_slot(cfg.engine_index, world)).__enter__()
    try:
        anyio.run(_serve, cfg)
    except KeyboardInterrupt:
        pass
    except BaseException:
        logger.exception("engine core %d failed", cfg.engine_index)
        code = 1
    finally:
        ignore_termination()
        if heartbeat is not None:
            heartbeat.__exit__(None, None, None)
            table.close()
        if os.getppid() != parent:  # orphaned: nobody else will remove this instance's files
            cfg.instance.cleanup()
    sys.exit(code)


def _first_message(exc: BaseException) -> str:
    """The first real error inside task groups' exception groups, as one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, (KeyboardInterrupt, anyio.get_cancelled_exc_class())):
        return ""
    return str(exc) or type(exc).__name__


def _make_executor_factory(cfg: EngineCoreProcConfig) -> Callable[[EngineConfig], Any]:
    # The model never runs in the engine core's process, at any TP size, so scheduling
    # overlaps the forward pass.
    from aserve.executor.multiproc import MultiprocExecutor

    return lambda config: MultiprocExecutor(config, instance=cfg.instance, dp_rank=cfg.engine_index,
                                            heartbeat_name=cfg.heartbeat_name, secret=cfg.secret)


class _Shutdown:
    pass


class _BusyLoop:
    """The loop that owns the ``EngineCore``; runs in a thread, talks through queues."""

    def __init__(self, core: EngineCore, engine_index: int, emit: Callable[[int, EngineCoreOutputs], None],
                 *, publish_counts: bool = False) -> None:
        self.core = core
        self.engine_index = engine_index
        self.publish_counts = publish_counts
        self.current_wave = 0
        self._last_counts: tuple[int, int] | None = None
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()
        self.aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._emit = emit
        self._client_of: dict[str, int] = {}

    def run(self) -> None:
        core = self.core
        while True:
            outputs: list[EngineCoreOutput] = []
            block = not core.has_unfinished_requests()
            try:
                item = self.inputs.get(block=block)
                while True:
                    if isinstance(item, _Shutdown):
                        return
                    self._handle(item, outputs)
                    item = self.inputs.get_nowait()
            except queue.Empty:
                pass
            if core.has_unfinished_requests():
                outputs.extend(core.step())
            while True:  # aborts that arrived during the step stop using the model now
                try:
                    outputs.extend(core.abort_requests(self.aborts.get_nowait()))
                except queue.Empty:
                    break
            if outputs:
                self._publish(outputs)
            if self.publish_counts:
                self._publish_counts()

    def _publish_counts(self) -> None:
        scheduler = self.core.scheduler
        counts = (scheduler.num_waiting, scheduler.num_running)
        if counts != self._last_counts:
            self._last_counts = counts
            stats = SchedulerStats(scheduler.num_running, scheduler.num_waiting, self.core.kv.usage)
            self._emit(COORDINATOR, EngineCoreOutputs(self.engine_index, scheduler_stats=stats))

    def _handle(self, item: tuple, outputs: list[EngineCoreOutput]) -> None:
        kind = item[0]
        if kind == "add":
            _, request, client = item
            self._client_of[request.request_id] = client
            if self.core.sleeping:  # refused, not queued: the caller says why (EngineSleepingError)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                                stop_reason=SLEEPING))
            else:
                self.core.add_prepared(request)
        elif kind == "abort":
            outputs.extend(self.core.abort_requests(item[1]))
        elif kind == "utility":
            _, call = item
            try:
                if call.method not in UTILITY_METHODS:
                    raise AserveError(f"unknown utility method {call.method!r}")
                reply = UtilityOutput(call.call_id, getattr(self.core, call.method)(*call.args))
            except Exception as exc:  # the caller gets the error; the engine goes on
                reply = UtilityOutput(call.call_id, None, f"{type(exc).__name__}: {exc}")
            self._emit(call.client_index, EngineCoreOutputs(self.engine_index, utility_output=reply))
        elif kind == "wave":
            # Dense engines are not in lockstep: the wave is only recorded (MoE would
            # start a wave of dummy steps here).
            self.current_wave = max(self.current_wave, item[1].wave)
        elif kind == "reject":
            _, request_id, client = item
            self._client_of[request_id] = client
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR))

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for out in outputs:
            client = self._client_of.get(out.request_id, 0)
            if out.finish_reason is not None:
                self._client_of.pop(out.request_id, None)
            by_client.setdefault(client, []).append(out)
        now = time.monotonic()
        for client, outs in by_client.items():
            self._emit(client, EngineCoreOutputs(self.engine_index, outs, now))


async def _serve(cfg: EngineCoreProcConfig) -> None:
    core = EngineCore(cfg.fitted, _make_executor_factory(cfg))
    ctx = zmq.Context()
    dealers: list[AsyncSocket] = []
    pushes: list[AsyncSocket] = []
    stats_push: AsyncSocket | None = None
    loop: _BusyLoop | None = None
    failed = True
    reason = ""  # why the engine stopped, sent with ENGINE_CORE_DEAD (text, not pickled)
    try:
        # Everything allocated so far lives as long as the process: keep the collector
        # from scanning it again on every collection.
        gc.collect()
        gc.freeze()
        identity = cfg.engine_index.to_bytes(2, "little")

        def connect(kind: int, address: str) -> AsyncSocket:
            return open_socket(ctx, kind, address, bind=False, secret=cfg.secret,
                               identity=identity if kind == zmq.DEALER else None)

        dealers = [connect(zmq.DEALER, address) for address in cfg.input_addresses]
        pushes = [connect(zmq.PUSH, address) for address in cfg.output_addresses]
        if cfg.coordinator_stats is not None:
            stats_push = connect(zmq.PUSH, cfg.coordinator_stats)
        if cfg.coordinator_input is not None:
            dealers.append(connect(zmq.DEALER, cfg.coordinator_input))
        # Now that the workers are started (they keep the kernel's default slice), this
        # process's threads, and the busy loop's thread to come, ask to be run promptly
        # when they wake (see request_short_slice).
        request_short_slice(ENGINE_CORE_SLICE_NS)
        ready = EngineReady(cfg.engine_index, core.config.max_model_len, core.config.cache.num_blocks or 0,
                            core.config.cache.block_size, core.kv_capacity_tokens)
        ready_body = msgspec.msgpack.encode(ready)
        for dealer in dealers[:len(cfg.input_addresses)]:
            await dealer.send_multipart([READY_FRAME, ready_body])

        send_outputs, receive_outputs = anyio.create_memory_object_stream[tuple[int, EngineCoreOutputs]](float("inf"))

        event_loop = asyncio.get_running_loop()  # the process runs on anyio's asyncio backend

        def emit(client: int, outputs: EngineCoreOutputs) -> None:
            # Handed over without waiting: the busy loop goes on to schedule the next
            # step while this thread sends. (It used to wait for the hand-over to run,
            # a round trip through this thread, which shares its core with the API
            # server, on every step.) The stream keeps the order.
            event_loop.call_soon_threadsafe(deliver, (client, outputs))

        def deliver(item: tuple[int, EngineCoreOutputs]) -> None:
            try:
                send_outputs.send_nowait(item)
            except anyio.ClosedResourceError:
                pass  # shutting down: the output task has stopped (ENGINE_CORE_DEAD follows)

        loop = _BusyLoop(core, cfg.engine_index, emit, publish_counts=stats_push is not None)

        async def input_task(sock: AsyncSocket, client: int) -> None:
            decoder = RequestDecoder()
            while True:
                frames = await sock.recv_multipart()
                try:
                    kind, body = decoder.decode(frames)
                except WireError as exc:
                    logger.warning("dropped a malformed message: %s", exc)
                    continue
                if kind is RequestType.ADD:
                    try:
                        loop.inputs.put(("add", core.prepare_request(body), body.client_index))
                    except AserveError as exc:
                        logger.warning("rejected request %s: %s", body.request_id, exc)
                        loop.inputs.put(("reject", body.request_id, body.client_index))
                elif kind is RequestType.ABORT:
                    loop.inputs.put(("abort", body))
                    loop.aborts.put(body)
                elif kind is RequestType.UTILITY:
                    loop.inputs.put(("utility", body))
                elif kind is RequestType.START_DP_WAVE:
                    loop.inputs.put(("wave", body))

        async def output_task() -> None:
            encoder = OutputsEncoder()
            async with receive_outputs:
                async for client, outputs in receive_outputs:
                    sock = stats_push if client == COORDINATOR else pushes[client]
                    # copy=True: zmq copies the bytes, so the encoder may reuse its buffer.
                    await sock.send_multipart([encoder.encode(outputs)], copy=True)

        # SIGTERM (from the parent, or the kernel when the parent dies, possibly more
        # than once) asks the busy loop to stop; cleanup then runs to the end. SIGINT
        # stays ignored (see interrupt_on_termination).
        def request_shutdown(signum: int, frame: object) -> None:
            loop.inputs.put(_Shutdown())

        signal.signal(signal.SIGTERM, request_shutdown)

        async def watch_worker(rank: int, proc: Any) -> None:
            # A worker that dies while the engine is idle is noticed here, not only at
            # the next step: the engine core then fails as a unit.
            await anyio.wait_readable(proc.sentinel)
            raise EngineDeadError(f"worker tp{rank} exited with code {proc.exitcode}")

        async with anyio.create_task_group() as tg:
            for client, dealer in enumerate(dealers):
                tg.start_soon(input_task, dealer, client)
            tg.start_soon(output_task)
            for rank, proc in enumerate(getattr(core.executor, "workers", [])):
                tg.start_soon(watch_worker, rank, proc)
            try:
                await anyio.to_thread.run_sync(loop.run, abandon_on_cancel=True)
            finally:
                send_outputs.close()
            tg.cancel_scope.cancel()
        failed = False
    except BaseException as exc:
        reason = _first_message(exc)
        raise
    finally:
        ignore_termination()  # a second SIGTERM must not cut the cleanup short
        if failed and loop is not None:
            loop.inputs.put(_Shutdown())  # release the busy loop's thread if it waits
        for push in pushes:  # the last message, on every exit path
            try:
                push.send_nowait([ENGINE_CORE_DEAD, reason.encode()[:1000]])
            except zmq.ZMQError:
                pass
        for sock in dealers:
            sock.close()
        if stats_push is not None:
            stats_push.close()
        for push in pushes:
            push.close(linger=2000)  # let ENGINE_CORE_DEAD reach the API servers
        ctx.term()
        core.shutdown()
