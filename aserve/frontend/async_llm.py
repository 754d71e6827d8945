"""``AsyncLLM``: the engine in its own processes, driven from asyncio or Trio.

::

    async with AsyncLLM(model=PATH, tensor_parallel_size=2) as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

Entering the block starts one engine-core process (which starts one worker process per
TP rank) and waits until the engine reports READY; leaving it, by any path, stops
them and removes their shared memory and IPC files.

Contracts:

- Cancelling the task that iterates ``generate`` (or closing the iterator) aborts the
  request in the engine: its KV blocks are free again after the next step.
- If any engine process dies, every request in flight raises ``EngineDeadError``
  within seconds, new requests raise it at once, and ``check_health()`` raises it.
- Bad input raises ``InvalidInputError`` before anything reaches the engine.
"""

from __future__ import annotations

import itertools
import logging
import math
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

from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY
from aserve.engine.core_process import READY_FRAME, EngineCoreProcConfig, run_engine_core
from aserve.engine.engine_core import fit_config
from aserve.errors import EngineDeadError, InvalidInputError
from aserve.frontend.input_processor import InputProcessor, PromptType
from aserve.frontend.engine_args import make_engine_config
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
    EngineReady,
    RequestEncoder,
    RequestType,
    UtilityRequest,
    WireError,
    decode_outputs,
)
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.async_llm")


@dataclass(frozen=True)
class EngineAttachment:
    """An engine core that someone else (the ``aserve run`` supervisor) started and owns.

    The ``AsyncLLM`` binds its sockets at the instance's addresses, waits for READY,
    watches the engine through a pidfd, and leaves stopping it and removing the
    instance's files to the owner.
    """

    instance_id: str
    instance_dir: str
    engine_pid: int


def engine_addresses(instance_dir: str) -> tuple[str, str]:
    """(requests address, outputs address) of an instance's single API server."""
    return f"ipc://{instance_dir}/input", f"ipc://{instance_dir}/output"


class AsyncLLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory: int = DEFAULT_CPU_KV_CACHE_MEMORY,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        startup_timeout: float = 600.0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        attach: EngineAttachment | None = None,
    ) -> None:
        self.config = make_engine_config(
            model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_model_len=max_model_len, seed=seed,
            kv_cache_memory=kv_cache_memory, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        )
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.attach = attach
        self._heartbeats: HeartbeatTable | None = None
        self._fitted = fit_config(self.config)  # bad directories and settings fail here, in the caller
        self.tokenizer = Tokenizer(Path(self.config.model.model))
        self.input_processor = InputProcessor.for_model(self._fitted, self.tokenizer)
        self._processor = OutputProcessor()
        self._streams: dict[str, Any] = {}
        self._pending_calls: dict[int, list[Any]] = {}
        self._call_ids = itertools.count()
        self._encoder = RequestEncoder()
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self.engine_process: mp.process.BaseProcess | None = None
        self.ready: EngineReady | None = None

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLM:
        if self.attach is not None:
            self.instance_id, self.instance_dir = self.attach.instance_id, self.attach.instance_dir
        else:
            self.instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
            self.instance_dir = tempfile.mkdtemp(prefix=f"{self.instance_id}-")
        input_address, output_address = engine_addresses(self.instance_dir)
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(input_address)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(output_address)
        self._router, self._pull = AsyncSocket(router), AsyncSocket(pull)
        self.dead_event = anyio.Event()  # set when the engine dies or is shut down
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        tp = self.config.parallel.tensor_parallel_size
        try:
            if self.attach is not None:
                self._heartbeats = HeartbeatTable(segment_name(self.instance_id), 1 + tp, create=False)
                self._engine_exit_fd = os.pidfd_open(self.attach.engine_pid)
            else:
                self._heartbeats = HeartbeatTable(segment_name(self.instance_id), 1 + tp, create=True)
                cfg = EngineCoreProcConfig(
                    engine=self.config, engine_index=0, input_addresses=(input_address,),
                    output_addresses=(output_address,), instance_dir=self.instance_dir, instance_id=self.instance_id,
                    heartbeat_name=segment_name(self.instance_id),
                )
                skip_resource_tracker()
                self.engine_process = mp.get_context("spawn").Process(target=run_engine_core, args=(cfg,),
                                                                      name="engine_core_0")
                self.engine_process.start()
                self._engine_exit_fd = self.engine_process.sentinel
            await self._wait_ready()
            self._tg.start_soon(self._output_loop)
            self._tg.start_soon(self._watch_process)
            self._tg.start_soon(self._watch_heartbeats)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def _wait_ready(self) -> None:
        async def process_exit() -> None:
            await anyio.wait_readable(self._engine_exit_fd)
            raise EngineDeadError(f"the engine core exited ({self._exit_status()}) while starting")

        with anyio.fail_after(self.startup_timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(process_exit)
                frames = await self._router.recv_multipart()
                tg.cancel_scope.cancel()
        if len(frames) != 3 or frames[1] != READY_FRAME:
            raise EngineDeadError("the engine core's first message was not READY")
        self.ready = msgspec.msgpack.decode(frames[2], type=EngineReady)
        self._engine_identity = frames[0]

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
        proc = self.engine_process
        if proc is not None and proc.exitcode is None:
            proc.terminate()
            await anyio.to_thread.run_sync(proc.join, 30)
            if proc.exitcode is None:
                proc.kill()
                await anyio.to_thread.run_sync(proc.join)
        self._router.close()
        self._pull.close()
        self._ctx.term()
        self._fail(EngineDeadError("the engine was shut down"))
        if self._heartbeats is not None:
            self._heartbeats.close()
        if self.attach is not None:
            if isinstance(getattr(self, "_engine_exit_fd", None), int):
                os.close(self._engine_exit_fd)
            return  # the owner stops the engine and removes the instance's files
        cleanup_instance(self.instance_id, self.instance_dir)

    # -- background tasks ---------------------------------------------------------

    def _exit_status(self) -> str:
        if self.engine_process is None:
            return "exit status unknown: not our child"
        return f"exit code {self.engine_process.exitcode}"

    async def _watch_process(self) -> None:
        await anyio.wait_readable(self._engine_exit_fd)
        if not self._stopping:
            self._fail(EngineDeadError(f"the engine core exited ({self._exit_status()})"))

    async def _watch_heartbeats(self) -> None:
        """A process that stops ticking for ``heartbeat_timeout`` counts as dead."""
        assert self._heartbeats is not None
        tp = self.config.parallel.tensor_parallel_size
        slots = {engine_slot(0, tp): "the engine core"}
        slots |= {worker_slot(0, tp, r): f"worker tp{r}" for r in range(tp)}
        monitor = HeartbeatMonitor(self._heartbeats, slots, self.heartbeat_timeout)
        while True:
            await anyio.sleep(HEARTBEAT_INTERVAL)
            stale = monitor.check(time.monotonic())
            if stale:
                self._fail(EngineDeadError(f"{stale[0]} stopped responding (no heartbeat for "
                                           f"{self.heartbeat_timeout:.0f} s)"))
                return

    async def _output_loop(self) -> None:
        while True:
            frames = await self._pull.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                self._fail(EngineDeadError("the engine core failed (ENGINE_CORE_DEAD)"))
                return
            try:
                outputs = decode_outputs(frames[0])
            except WireError as exc:
                logger.warning("dropped a malformed message from the engine: %s", exc)
                continue
            if outputs.utility_output is not None:
                entry = self._pending_calls.pop(outputs.utility_output.call_id, None)
                if entry is not None:
                    entry[1] = outputs.utility_output
                    entry[0].set()
            if not outputs.outputs:
                continue
            results, to_abort = self._processor.process(outputs.outputs)
            if to_abort:
                self._send(RequestType.ABORT, to_abort)
            for result in results:
                stream = self._streams.get(result.request_id)
                if stream is not None:
                    stream.send_nowait(result)

    def _fail(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            self.dead_event.set()
        for stream in list(self._streams.values()):
            try:
                stream.send_nowait(error)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        for entry in self._pending_calls.values():
            entry[1] = error
            entry[0].set()
        self._pending_calls.clear()

    def _send(self, kind: RequestType, body: Any = None) -> None:
        self._router.send_nowait([self._engine_identity, *self._encoder.encode(kind, body)])

    # -- public API -----------------------------------------------------------------

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
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative, delta or final-only per
        ``sampling_params.output_kind``) until it finishes.

        Raises ``InvalidInputError`` for bad input (nothing is sent), ``EngineDeadError``
        if the engine dies. Cancellation or closing the iterator aborts the request.
        """
        self._check_alive()
        params = sampling_params or SamplingParams()
        self.input_processor.check_params(params)
        text, ids = self.input_processor.tokenize(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidInputError(f"request id {request_id!r} is already in use", param="request_id")
        state = RequestState(request_id, text, ids, params, self.tokenizer)
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        self._streams[request_id] = send
        self._processor.add(state)
        finished = False
        try:
            for i in range(params.n):
                request = self.input_processor.make_request(child_request_id(request_id, i, params.n), ids,
                                                            child_params(params, i), priority=priority)
                self._send(RequestType.ADD, request)
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    finished = item.finished
                    yield item
                    if finished:
                        return
        finally:
            self._streams.pop(request_id, None)
            send.close()
            if not finished:
                abandoned = self._processor.remove(request_id)
                if abandoned is not None and self._dead is None and not self._stopping:
                    self._send(RequestType.ABORT, abandoned.child_ids)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` iterator ends with finish reason "abort"."""
        state = self._processor.remove(request_id)
        if state is None:
            return
        if self._dead is None:
            self._send(RequestType.ABORT, state.child_ids)
        state.finish_all("abort")
        stream = self._streams.get(request_id)
        output = state.make_output()
        if stream is not None and output is not None:
            stream.send_nowait(output)

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine is dead; return if it answers."""
        self._check_alive()
        await self._call_utility("ping")

    async def reset_prefix_cache(self) -> None:
        await self._call_utility("reset_prefix_cache")

    async def get_stats(self) -> dict[str, float]:
        """The engine's counts: running, waiting, KV usage, free blocks."""
        return await self._call_utility("get_stats")

    async def _call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        entry: list[Any] = [anyio.Event(), None]
        self._pending_calls[call_id] = entry
        self._send(RequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
        await entry[0].wait()
        result = entry[1]
        if isinstance(result, BaseException):
            raise result
        if result.error is not None:
            raise RuntimeError(f"engine utility {method} failed: {result.error}")
        return result.result

