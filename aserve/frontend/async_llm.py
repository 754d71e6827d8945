"""``AsyncLLM``: the engine in its own processes, driven from asyncio or Trio.

::

    async with AsyncLLM(model=PATH, tensor_parallel_size=2) as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

Entering the block starts ``data_parallel_size`` engine-core processes (each starts one
worker process per TP rank; with more than one, a DP coordinator process too) and waits
until every engine reports READY; leaving it, by any path, stops them and removes their
shared memory and IPC files. With several engines, each request goes to the engine
with the lowest load score (``aserve.frontend.load_balancer``).

Contracts:

- Cancelling the task that iterates ``generate`` (or closing the iterator) aborts the
  request in the engine: its KV blocks are free again after the next step.
- If any engine process dies, every request in flight raises ``EngineDeadError``
  within seconds, new requests raise it at once, and ``check_health()`` raises it.
- Bad input raises ``InvalidInputError`` before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_PREFIX_CACHE_RESERVE
from aserve.engine.core_process import READY_FRAME
from aserve.engine.engine_core import fit_config
from aserve.errors import EngineDeadError, InvalidInputError, unwrap_errors
from aserve.frontend.input_processor import InputProcessor, PromptType
from aserve.frontend.engine_args import make_engine_config
from aserve.frontend.load_balancer import EngineLoad, LoadBalancer
from aserve.launch.engines import create_heartbeats, spawn_coordinator, spawn_engine_cores
from aserve.launch.heartbeat import DEFAULT_TIMEOUT as DEFAULT_HEARTBEAT_TIMEOUT
from aserve.launch.heartbeat import INTERVAL as HEARTBEAT_INTERVAL
from aserve.launch.heartbeat import HeartbeatMonitor, HeartbeatTable, engine_slot, segment_name, worker_slot
from aserve.launch.process_utils import cleanup_instance, skip_resource_tracker
from aserve.frontend.output_processor import OutputProcessor, RequestState, child_params, child_request_id
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams
from aserve.tokenizer import Tokenizer
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
from aserve.wire.addresses import WireAddresses, ipc_addresses
from aserve.wire.auth import secure_server
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.async_llm")


@dataclass(frozen=True)
class EngineAttachment:
    """Engine cores that someone else (the ``aserve run`` supervisor) started and owns.

    The ``AsyncLLM`` binds this API server's sockets (``addresses``' entry
    ``client_index``), waits for READY from every engine, watches the local ones through
    pidfds (remote ones are watched by their own node, which reports their death), and
    leaves stopping them and removing the instance's files to the owner.
    """

    instance_id: str
    instance_dir: str
    addresses: WireAddresses
    engine_pids: dict[int, int]  # DP rank -> pid of engines this API server watches itself
    local_ranks: tuple[int, ...] = (0,)  # engines on this machine: their heartbeats are watched
    client_index: int = 0
    secret: bytes | None = None  # CURVE for tcp:// binds (multi-node)
    report: Any = None  # a multiprocessing Connection that gets the bound endpoints (tcp port 0)


class _Wakeup:
    """A level-triggered flag one task waits on and any code in the same event loop sets;
    ``set`` never blocks and repeated sets before a wait count once.

    Every streamed request waits on one once per engine step. Under asyncio the waiter
    is a bare future of the running loop (1.3 us a wait-and-wake on uvloop, against 3.7
    for a fresh ``anyio.Event``, which wraps an ``asyncio.Event`` that takes a global
    lock on its first wait); under Trio it is an ``anyio.Event``."""

    __slots__ = ("_flag", "_waiter")

    def __init__(self) -> None:
        self._flag = False
        self._waiter: asyncio.Future[None] | anyio.Event | None = None

    def set(self) -> None:
        self._flag = True
        waiter = self._waiter
        if waiter is None:
            return
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(None)
        else:
            waiter.set()

    async def wait(self) -> None:
        """Return once the flag is set (at once if it already is), clearing it."""
        if not self._flag:
            loop = asyncio._get_running_loop()  # None under Trio
            try:
                if loop is not None:
                    future = self._waiter = loop.create_future()
                    await future
                else:
                    event = self._waiter = anyio.Event()
                    await event.wait()
            finally:
                self._waiter = None
        self._flag = False


@dataclass
class _Engine:
    rank: int
    identity: bytes
    exit_fd: int | None = None  # readable once the process has exited; None: on another machine
    process: mp.process.BaseProcess | None = None  # when this AsyncLLM started it
    ready: EngineReady | None = None


class AsyncLLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        worker_threads: int | None = None,
        cpu_affinity: bool = True,
        tp_comm: str = "auto",
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory: int = DEFAULT_CPU_KV_CACHE_MEMORY,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefix_cache_reserve: float = DEFAULT_PREFIX_CACHE_RESERVE,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        startup_timeout: float = 600.0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        attach: EngineAttachment | None = None,
    ) -> None:
        self.config = make_engine_config(
            model, tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
            worker_threads=worker_threads, cpu_affinity=cpu_affinity, tp_comm=tp_comm, device=device,
            dtype=dtype, max_model_len=max_model_len, seed=seed, kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching, prefix_cache_reserve=prefix_cache_reserve,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.attach = attach
        self.num_engines = data_parallel_size
        self.client_index = attach.client_index if attach is not None else 0
        client_count = attach.addresses.api_count if attach is not None else 1
        self._lb = LoadBalancer(self.num_engines, client_index=self.client_index, client_count=client_count)
        self._engines = [_Engine(rank, rank.to_bytes(2, "little")) for rank in range(self.num_engines)]
        self._engine_of: dict[str, int] = {}  # request id -> DP rank serving it
        self._wave = 0
        self._heartbeats: HeartbeatTable | None = None
        self._fitted = fit_config(self.config)  # bad directories and settings fail here, in the caller
        self.tokenizer = Tokenizer(Path(self.config.model.model))
        self.input_processor = InputProcessor.for_model(self._fitted, self.tokenizer)
        self._processor = OutputProcessor()
        self._streams: dict[str, _Wakeup] = {}  # request id -> its generate iterator's wake-up
        self._pending_calls: dict[int, list[Any]] = {}
        self._call_ids = itertools.count()
        self._encoder = RequestEncoder()
        self._dead: EngineDeadError | None = None
        self.failure: EngineDeadError | None = None  # why an engine died, unless this AsyncLLM stopped them
        self._stopping = False
        self.coordinator_process: mp.process.BaseProcess | None = None
        self._sockets: list[AsyncSocket] = []

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLM:
        if self.attach is not None:
            self.instance_id, self.instance_dir = self.attach.instance_id, self.attach.instance_dir
            addresses, secret = self.attach.addresses, self.attach.secret
        else:
            self.instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
            self.instance_dir = tempfile.mkdtemp(prefix=f"{self.instance_id}-")
            addresses = ipc_addresses(self.instance_dir, 1, coordinator=self.num_engines > 1)
            secret = None
        self._ctx = zmq.Context()

        def bind(kind: int, address: str) -> AsyncSocket:
            sock = self._ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if kind == zmq.ROUTER:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if address.startswith("tcp://"):
                secure_server(sock, secret)
            sock.bind(address)
            wrapped = AsyncSocket(sock)
            self._sockets.append(wrapped)
            return wrapped

        self._router = bind(zmq.ROUTER, addresses.api_inputs[self.client_index])
        self._pull = bind(zmq.PULL, addresses.api_outputs[self.client_index])
        self._sub: AsyncSocket | None = None
        if addresses.coordinator_publish is not None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(addresses.coordinator_publish)
            self._sub = AsyncSocket(sub)
            self._sockets.append(self._sub)
        if self.attach is not None and self.attach.report is not None:
            self.attach.report.send([s.socket.last_endpoint.decode() for s in (self._router, self._pull)])
        self.dead_event = anyio.Event()  # set when an engine dies or the engines are shut down
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        tp = self.config.parallel.tensor_parallel_size
        try:
            if self.attach is not None:
                self._heartbeats = HeartbeatTable(segment_name(self.instance_id),
                                                  self.num_engines * (1 + tp), create=False)
                for rank, pid in self.attach.engine_pids.items():
                    self._engines[rank].exit_fd = os.pidfd_open(pid)
            else:
                skip_resource_tracker()
                name = create_heartbeats(self.instance_id, self.config, range(self.num_engines))
                self._heartbeats = HeartbeatTable(name, self.num_engines * (1 + tp), create=False)
                if self.num_engines > 1:
                    self.coordinator_process = spawn_coordinator(self.num_engines, addresses)
                procs = spawn_engine_cores(self.config, addresses, range(self.num_engines),
                                           instance_id=self.instance_id, instance_dir=self.instance_dir,
                                           heartbeat_name=name)
                for rank, proc in procs.items():
                    self._engines[rank].process, self._engines[rank].exit_fd = proc, proc.sentinel
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

    async def _wait_ready(self) -> None:
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
                if ready.max_model_len != self.max_model_len:
                    raise EngineDeadError(
                        f"engine {ready.engine_index} fitted max_model_len {ready.max_model_len}, this front end "
                        f"{self.max_model_len}: start every node with the same model and settings")
                self._engines[ready.engine_index].ready = ready
            scope.cancel()

        with anyio.fail_after(self.startup_timeout), unwrap_errors():
            async with anyio.create_task_group() as tg:
                for engine in self._engines:
                    if engine.exit_fd is not None:
                        tg.start_soon(process_exit, engine)
                tg.start_soon(readiness, tg.cancel_scope)

    @property
    def ready(self) -> EngineReady | None:
        """Engine 0's READY once every engine has sent its own; None until then."""
        if any(e.ready is None for e in self._engines):
            return None
        return self._engines[0].ready

    @property
    def engine_process(self) -> mp.process.BaseProcess | None:
        """Engine core 0's process, when this AsyncLLM started it."""
        return self._engines[0].process

    @property
    def engine_processes(self) -> list[mp.process.BaseProcess]:
        return [e.process for e in self._engines if e.process is not None]

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping = True
        try:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        finally:
            # Shielded: stopping the processes and removing their files must finish
            # even when the caller is being cancelled.
            with anyio.CancelScope(shield=True):
                await self._stop_processes()

    async def _stop_processes(self) -> None:
        procs = [*self.engine_processes, *([self.coordinator_process] if self.coordinator_process else [])]
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            await anyio.to_thread.run_sync(proc.join, 30)
            if proc.exitcode is None:
                # Its own children (workers) are then left to notice their parent's death.
                logger.warning("%s (pid %d) did not exit within 30 s of SIGTERM; killing it", proc.name, proc.pid)
                proc.kill()
                await anyio.to_thread.run_sync(proc.join)
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
        cleanup_instance(self.instance_id, self.instance_dir)

    # -- background tasks ---------------------------------------------------------

    def _exit_status(self, engine: _Engine) -> str:
        if engine.process is None:
            return "its supervisor has the exit code"
        return f"exit code {engine.process.exitcode}"

    async def _watch_process(self, engine: _Engine) -> None:
        await anyio.wait_readable(engine.exit_fd)
        if not self._stopping:
            self._fail(EngineDeadError(f"engine core {engine.rank} exited ({self._exit_status(engine)})"))

    async def _watch_coordinator(self) -> None:
        await anyio.wait_readable(self.coordinator_process.sentinel)
        if not self._stopping:
            self._fail(EngineDeadError(f"the DP coordinator exited (exit code {self.coordinator_process.exitcode})"))

    async def _watch_heartbeats(self) -> None:
        """A process that stops ticking for ``heartbeat_timeout`` counts as dead."""
        assert self._heartbeats is not None
        tp = self.config.parallel.tensor_parallel_size
        local = self.attach.local_ranks if self.attach is not None else range(self.num_engines)
        slots = {}
        for d in local:  # engines on other machines are watched by their own node
            slots[engine_slot(d, tp)] = f"engine core {d}"
            slots |= {worker_slot(d, tp, r): f"worker tp{r} of engine {d}" for r in range(tp)}
        monitor = HeartbeatMonitor(self._heartbeats, slots, self.heartbeat_timeout)
        while True:
            await anyio.sleep(HEARTBEAT_INTERVAL)
            stale = monitor.check(time.monotonic())
            if stale:
                self._fail(EngineDeadError(f"{stale[0]} stopped responding (no heartbeat for "
                                           f"{self.heartbeat_timeout:.0f} s)"))
                return

    async def _load_loop(self) -> None:
        """The coordinator's published figures replace the load balancer's guesses."""
        assert self._sub is not None
        decoder = msgspec.msgpack.Decoder(DPLoads)
        while True:
            frames = await self._sub.recv_multipart()
            try:
                loads = decoder.decode(frames[0])
                self._lb.update([EngineLoad(*x) for x in loads.loads])
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                logger.warning("dropped a malformed message from the coordinator: %s", exc)
                continue
            self._wave = loads.wave

    async def _output_loop(self) -> None:
        while True:
            frames = await self._pull.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                if not self._stopping:
                    self._fail(EngineDeadError("an engine core stopped (ENGINE_CORE_DEAD)"))
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
            if not outputs.outputs:
                continue
            touched, to_abort = self._processor.apply(outputs.outputs)
            if to_abort:
                self._send(RequestType.ABORT, to_abort, outputs.engine_index)
            for state in touched:
                wakeup = self._streams.get(state.request_id)
                if wakeup is not None:
                    wakeup.set()

    def _fail(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            if not self._stopping:
                self.failure = error
            self.dead_event.set()
        for wakeup in list(self._streams.values()):
            wakeup.set()
        for entry in self._pending_calls.values():
            entry[1] = error
            entry[0].set()
        self._pending_calls.clear()

    def _send(self, kind: RequestType, body: Any, engine: int) -> None:
        self._router.send_nowait([self._engines[engine].identity, *self._encoder.encode(kind, body)])

    def _release(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self._lb.finished(engine)

    # -- public API -----------------------------------------------------------------

    def engine_for(self, request_id: str) -> int | None:
        """The DP rank of the engine serving a request in progress."""
        return self._engine_of.get(request_id)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative, delta or final-only per
        ``sampling_params.output_kind``) until it finishes.

        With several engines, the load balancer picks one (``data_parallel_rank`` pins
        it); every ``n`` child of the request goes to the same engine, so they share
        the prompt's cached blocks. Raises ``InvalidInputError`` for bad input (nothing
        is sent), ``EngineDeadError`` if an engine dies. Cancellation or closing the
        iterator aborts the request.
        """
        self._check_alive()
        params = sampling_params or SamplingParams()
        self.input_processor.check_params(params)
        text, ids = self.input_processor.tokenize(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidInputError(f"request id {request_id!r} is already in use", param="request_id")
        state = RequestState(request_id, text, ids, params, self.tokenizer)
        engine = self._lb.pick(data_parallel_rank)  # counted in flight from here: released in finally
        wakeup = _Wakeup()
        self._streams[request_id] = wakeup
        self._engine_of[request_id] = engine
        self._processor.add(state)
        finished = False
        try:
            for i in range(params.n):
                request = self.input_processor.make_request(child_request_id(request_id, i, params.n), ids,
                                                            child_params(params, i), priority=priority)
                request.client_index = self.client_index
                request.current_wave = self._wave
                self._send(RequestType.ADD, request, engine)
            # The output loop only applies engine outputs to ``state`` and wakes this
            # iterator; the RequestOutput is made here, when the consumer is ready for
            # it. So a consumer that fell behind (a slow client, a busy API server) gets
            # one delta covering every step it missed rather than one per step, as
            # vLLM's output collector merges them.
            while True:
                await wakeup.wait()
                if self._dead is not None and not state.finished:
                    raise self._dead
                output = state.make_output()
                if output is None:
                    continue
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._release(request_id)
            if not finished:
                abandoned = self._processor.remove(request_id)
                if abandoned is not None and self._dead is None and not self._stopping:
                    self._send(RequestType.ABORT, abandoned.child_ids, engine)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` iterator ends with finish reason "abort"."""
        state = self._processor.remove(request_id)
        if state is None:
            return
        engine = self._engine_of.get(request_id)
        if self._dead is None and engine is not None:
            self._send(RequestType.ABORT, state.child_ids, engine)
        state.finish_all("abort")
        wakeup = self._streams.get(request_id)
        if wakeup is not None:
            wakeup.set()

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if any engine is dead; return once every one answers."""
        self._check_alive()
        for engine in range(self.num_engines):
            await self._call_utility("ping", engine=engine)

    async def reset_prefix_cache(self) -> None:
        for engine in range(self.num_engines):
            await self._call_utility("reset_prefix_cache", engine=engine)

    async def get_stats(self, engine: int = 0) -> dict[str, float]:
        """Engine ``engine``'s counts: running, waiting, KV usage, free blocks, and its
        totals of finished requests and tokens."""
        return await self._call_utility("get_stats", engine=engine)

    async def _call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
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

