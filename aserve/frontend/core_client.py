"""``EngineCoreClient``: the front end's end of wire 1 (vLLM's name for the same seam).

One client serves one ``AsyncLLM`` (inside an API server, or in an application). It:

- owns the engine processes (starts the engine cores and, with several engines, the DP
  coordinator, and stops them and removes the instance's files however it is left), or
  attaches to engines that the ``aserve run`` supervisor owns (:class:`EngineAttachment`);
- binds this front end's sockets (a ROUTER for requests, a PULL for outputs, a SUB for
  the coordinator's load figures) and waits for every engine's READY;
- runs the output loop (each engine step's outputs go to ``on_outputs``), the load loop
  (the coordinator's figures replace the load balancer's guesses) and utility calls;
- watches the engines' health: a local engine process that exits (seen through its
  pidfd or sentinel), a heartbeat that stops, or ``ENGINE_CORE_DEAD`` on the wire marks
  the client dead with an ``EngineDeadError``, and ``on_dead`` is called.

Contracts: :meth:`add`, :meth:`abort` never wait; :meth:`call_utility` raises
``EngineDeadError`` if the engines die first; leaving the ``async with`` block stops
everything it started (shielded from cancellation) and fails every waiting call.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import zmq

from aserve.engine.coordinator_logic import EngineLoad
from aserve.engine.core_process import READY_FRAME
from aserve.engine.fit import FittedConfig
from aserve.engine.spawn import create_heartbeats, spawn_coordinator, spawn_engine_cores
from aserve.errors import EngineDeadError, unwrap_errors
from aserve.frontend.load_balancer import LoadBalancer
from aserve.process.heartbeat import INTERVAL as HEARTBEAT_INTERVAL
from aserve.process.heartbeat import HeartbeatMonitor, HeartbeatTable, engine_slot, segment_name, worker_slot
from aserve.process.instance import Instance
from aserve.process.stop import stop_processes_async
from aserve.process.utils import skip_resource_tracker
from aserve.wire.addresses import WireAddresses, ipc_addresses
from aserve.wire.codec import (
    ENGINE_CORE_DEAD,
    DPLoads,
    EngineReady,
    RequestEncoder,
    RequestType,
    UtilityRequest,
    WireError,
    decode_outputs,
)
from aserve.wire.messages import EngineCoreOutput, EngineCoreRequest
from aserve.wire.sockets import endpoint, open_socket
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.core_client")

#: Seconds an engine process gets to stop after SIGTERM before it is killed.
STOP_GRACE = 30.0


@dataclass(frozen=True)
class EngineAttachment:
    """Engine cores that someone else (the ``aserve run`` supervisor) started and owns.

    The client binds this API server's sockets (``addresses``' entry ``client_index``),
    waits for READY from every engine, watches the local ones through pidfds (remote ones
    are watched by their own node, which reports their death), and leaves stopping them
    and removing the instance's files to the owner.
    """

    instance: Instance
    addresses: WireAddresses
    engine_pids: dict[int, int]  # DP rank -> pid of engines this API server watches itself
    local_ranks: tuple[int, ...] = (0,)  # engines on this machine: their heartbeats are watched
    client_index: int = 0
    secret: bytes | None = None  # CURVE for tcp:// binds (multi-node)
    report: Any = None  # a multiprocessing Connection that gets the bound endpoints (tcp port 0)


@dataclass
class _Engine:
    rank: int
    identity: bytes
    exit_fd: int | None = None  # readable once the process has exited; None: on another machine
    process: mp.process.BaseProcess | None = None  # when this client started it
    ready: EngineReady | None = None


OutputsHandler = Callable[[int, list[EngineCoreOutput]], None]


class EngineCoreClient:
    def __init__(self, fitted: FittedConfig, *, on_outputs: OutputsHandler, on_dead: Callable[[], None],
                 attach: EngineAttachment | None = None) -> None:
        """``on_outputs(engine_index, outputs)`` gets each engine step's request outputs;
        ``on_dead()`` is called (once or more) when the engines die or are stopped. Both
        run in the event loop and must not block."""
        self.fitted = fitted
        self.config = fitted.config
        self.attach = attach
        self.num_engines = self.config.parallel.data_parallel_size
        self.client_index = attach.client_index if attach is not None else 0
        client_count = attach.addresses.api_count if attach is not None else 1
        self.load_balancer = LoadBalancer(self.num_engines, client_index=self.client_index, client_count=client_count)
        self.wave = 0  # the DP wave the coordinator last published
        self.instance: Instance | None = attach.instance if attach is not None else None
        self.coordinator_process: mp.process.BaseProcess | None = None
        self.dead: EngineDeadError | None = None
        self.failure: EngineDeadError | None = None  # why an engine died, unless this client stopped them
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._engines = [_Engine(rank, rank.to_bytes(2, "little")) for rank in range(self.num_engines)]
        self._heartbeats: HeartbeatTable | None = None
        self._pending_calls: dict[int, list[Any]] = {}
        self._next_call_id = 0
        self._encoder = RequestEncoder()
        self._stopping = False
        self._sockets: list[AsyncSocket] = []

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> EngineCoreClient:
        if self.attach is not None:
            addresses, secret = self.attach.addresses, self.attach.secret
        else:
            self.instance = Instance.create()
            addresses = ipc_addresses(self.instance.dir, 1, coordinator=self.num_engines > 1)
            secret = None
        self._ctx = zmq.Context()
        self.dead_event = anyio.Event()  # set when an engine dies or the engines are shut down
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._router = self._bind(zmq.ROUTER, addresses.api_inputs[self.client_index], secret)
            self._pull = self._bind(zmq.PULL, addresses.api_outputs[self.client_index], secret)
            self._sub: AsyncSocket | None = None
            if addresses.coordinator_publish is not None:
                self._sub = open_socket(self._ctx, zmq.SUB, addresses.coordinator_publish, bind=False)
                self._sockets.append(self._sub)
            if self.attach is not None and self.attach.report is not None:
                self.attach.report.send([endpoint(s) for s in (self._router, self._pull)])
            await self._start_or_attach(addresses)
            await self._wait_ready()
            self._tg.start_soon(self._output_loop)
            if self._sub is not None:
                self._tg.start_soon(self._load_loop)
            for engine in self._engines:
                if engine.exit_fd is not None:
                    self._tg.start_soon(self._watch_process, engine)
            if self.coordinator_process is not None:
                self._tg.start_soon(self._watch_coordinator)
            self._tg.start_soon(self._watch_heartbeats)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _bind(self, kind: int, address: str, secret: bytes | None) -> AsyncSocket:
        sock = open_socket(self._ctx, kind, address, bind=True, secret=secret, router_mandatory=True)
        self._sockets.append(sock)
        return sock

    async def _start_or_attach(self, addresses: WireAddresses) -> None:
        assert self.instance is not None
        slots = self.num_engines * (1 + self.config.parallel.world_size)
        if self.attach is not None:
            self._heartbeats = HeartbeatTable(segment_name(self.instance.id), slots, create=False)
            for rank, pid in self.attach.engine_pids.items():
                self._engines[rank].exit_fd = os.pidfd_open(pid)
            return
        skip_resource_tracker()
        name = create_heartbeats(self.instance, self.config.parallel.world_size, range(self.num_engines))
        self._heartbeats = HeartbeatTable(name, slots, create=False)
        if self.num_engines > 1:
            self.coordinator_process = spawn_coordinator(self.num_engines, addresses)
        procs = spawn_engine_cores(self.fitted, addresses, range(self.num_engines), instance=self.instance,
                                   heartbeat_name=name)
        for rank, proc in procs.items():
            self._engines[rank].process, self._engines[rank].exit_fd = proc, proc.sentinel

    async def _wait_ready(self) -> None:
        max_model_len = self.config.max_model_len

        async def process_exit(engine: _Engine) -> None:
            await anyio.wait_readable(engine.exit_fd)
            raise EngineDeadError(f"engine core {engine.rank} exited ({self._exit_status(engine)}) while starting")

        async def readiness(scope: anyio.CancelScope) -> None:
            while any(e.ready is None for e in self._engines):
                frames = await self._router.recv_multipart()
                if len(frames) != 3 or frames[1] != READY_FRAME:
                    raise EngineDeadError("an engine core's first message was not READY")
                ready = msgspec.msgpack.decode(frames[2], type=EngineReady)
                if not 0 <= ready.engine_index < self.num_engines or frames[0] != self._engines[ready.engine_index].identity:
                    raise EngineDeadError(f"READY from an unexpected engine ({ready.engine_index})")
                if ready.max_model_len != max_model_len:
                    raise EngineDeadError(
                        f"engine {ready.engine_index} fitted max_model_len {ready.max_model_len}, this front end "
                        f"{max_model_len}: start every node with the same model and settings")
                self._engines[ready.engine_index].ready = ready
            scope.cancel()

        with anyio.fail_after(self.config.health.startup_timeout), unwrap_errors():
            async with anyio.create_task_group() as tg:
                for engine in self._engines:
                    if engine.exit_fd is not None:
                        tg.start_soon(process_exit, engine)
                tg.start_soon(readiness, tg.cancel_scope)

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping = True
        try:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        finally:
            # Shielded: stopping the processes and removing their files must finish
            # even when the caller is being cancelled.
            with anyio.CancelScope(shield=True):
                await self._stop()

    async def _stop(self) -> None:
        owned = [*self.engine_processes, *([self.coordinator_process] if self.coordinator_process else [])]
        # Their own children (workers) are left to notice their parent's death if one is killed.
        await stop_processes_async(owned, grace=STOP_GRACE)
        for sock in self._sockets:
            sock.close()
        self._ctx.term()
        self._fail(EngineDeadError("the engine was shut down"))
        if self._heartbeats is not None:
            self._heartbeats.close()
        if self.attach is not None:
            for engine in self._engines:
                if engine.exit_fd is not None:
                    os.close(engine.exit_fd)
            return  # the owner stops the engines and removes the instance's files
        if self.instance is not None:
            self.instance.cleanup()

    # -- state ----------------------------------------------------------------------

    @property
    def ready(self) -> EngineReady | None:
        """Engine 0's READY once every engine has sent its own; None until then."""
        if any(e.ready is None for e in self._engines):
            return None
        return self._engines[0].ready

    @property
    def engine_process(self) -> mp.process.BaseProcess | None:
        """Engine core 0's process, when this client started it."""
        return self._engines[0].process

    @property
    def engine_processes(self) -> list[mp.process.BaseProcess]:
        return [e.process for e in self._engines if e.process is not None]

    def check_alive(self) -> None:
        """Raise the ``EngineDeadError`` that killed the engines, if they died."""
        if self.dead is not None:
            raise self.dead

    # -- sending --------------------------------------------------------------------

    def add(self, request: EngineCoreRequest, engine: int) -> None:
        """Send an ADD to DP engine ``engine``; stamps this client's index and wave."""
        request.client_index = self.client_index
        request.current_wave = self.wave
        self._send(RequestType.ADD, request, engine)

    def abort(self, request_ids: list[str], engine: int) -> None:
        """Send an ABORT unless the engines are dead or being stopped (nothing to abort)."""
        if self.dead is None and not self._stopping:
            self._send(RequestType.ABORT, request_ids, engine)

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        """Call engine-core method ``method`` (``UTILITY_METHODS``) on engine ``engine``."""
        self.check_alive()
        call_id = self._next_call_id
        self._next_call_id += 1
        entry: list[Any] = [anyio.Event(), None]
        self._pending_calls[call_id] = entry
        self._send(RequestType.UTILITY, UtilityRequest(self.client_index, call_id, method, list(args)), engine)
        await entry[0].wait()
        result = entry[1]
        if isinstance(result, BaseException):
            raise result
        if result.error is not None:
            raise RuntimeError(f"engine utility {method} failed: {result.error}")
        return result.result

    def _send(self, kind: RequestType, body: Any, engine: int) -> None:
        self._router.send_nowait([self._engines[engine].identity, *self._encoder.encode(kind, body)])

    # -- background tasks -----------------------------------------------------------

    def _exit_status(self, engine: _Engine) -> str:
        if engine.process is None:
            return "its supervisor has the exit code"
        return f"exit code {engine.process.exitcode}"

    async def _watch_process(self, engine: _Engine) -> None:
        await anyio.wait_readable(engine.exit_fd)
        if not self._stopping:
            self._fail(EngineDeadError(f"engine core {engine.rank} exited ({self._exit_status(engine)})"))

    async def _watch_coordinator(self) -> None:
        proc = self.coordinator_process
        await anyio.wait_readable(proc.sentinel)
        if not self._stopping:
            self._fail(EngineDeadError(f"the DP coordinator exited (exit code {proc.exitcode})"))

    async def _watch_heartbeats(self) -> None:
        """A process that stops ticking for ``heartbeat_timeout`` counts as dead."""
        assert self._heartbeats is not None
        world, tp = self.config.parallel.world_size, self.config.parallel.tensor_parallel_size
        timeout = self.config.health.heartbeat_timeout
        local = self.attach.local_ranks if self.attach is not None else range(self.num_engines)
        slots = {}
        for d in local:  # engines on other machines are watched by their own node
            slots[engine_slot(d, world)] = f"engine core {d}"
            slots |= {worker_slot(d, world, r): f"worker {'' if world == tp else f'pp{r // tp}_'}tp{r % tp} of engine {d}"
                      for r in range(world)}
        monitor = HeartbeatMonitor(self._heartbeats, slots, timeout)
        while True:
            await anyio.sleep(HEARTBEAT_INTERVAL)
            stale = monitor.check(time.monotonic())
            if stale:
                self._fail(EngineDeadError(f"{stale[0]} stopped responding (no heartbeat for {timeout:.0f} s)"))
                return

    async def _load_loop(self) -> None:
        """The coordinator's published figures replace the load balancer's guesses."""
        assert self._sub is not None
        decoder = msgspec.msgpack.Decoder(DPLoads)
        while True:
            frames = await self._sub.recv_multipart()
            try:
                loads = decoder.decode(frames[0])
                self.load_balancer.update([EngineLoad(*x) for x in loads.loads])
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                logger.warning("dropped a malformed message from the coordinator: %s", exc)
                continue
            self.wave = loads.wave

    async def _output_loop(self) -> None:
        while True:
            frames = await self._pull.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                if not self._stopping:
                    why = frames[1].decode(errors="replace") if len(frames) > 1 else ""
                    self._fail(EngineDeadError(f"an engine core stopped: {why}" if why
                                               else "an engine core stopped (ENGINE_CORE_DEAD)"))
                return
            try:
                outputs = decode_outputs(frames[0])
            except WireError as exc:
                logger.warning("dropped a malformed message from an engine: %s", exc)
                continue
            if outputs.utility_output is not None:
                entry = self._pending_calls.pop(outputs.utility_output.call_id, None)
                if entry is not None:
                    entry[1] = outputs.utility_output
                    entry[0].set()
            if outputs.outputs:
                self._on_outputs(outputs.engine_index, outputs.outputs)

    def _fail(self, error: EngineDeadError) -> None:
        if self.dead is None:
            self.dead = error
            if not self._stopping:
                self.failure = error
            self.dead_event.set()
        self._on_dead()
        for entry in self._pending_calls.values():
            entry[1] = error
            entry[0].set()
        self._pending_calls.clear()
