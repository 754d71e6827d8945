"""Runs the model in worker processes, one per TP rank of each pipeline stage, over
shared-memory rings.

The engine core writes each call once to a broadcast ring that every worker reads;
the call's output rank replies on its own response ring: for a step, the first TP rank
of the last stage (rank 0 without pipeline stages), which samples; for a utility call,
rank 0. A wait for a reply
looks at the workers every second: a worker that died (or, given the instance's
heartbeat segment, stopped ticking for ``heartbeat_timeout``) fails the executor with
``EngineDeadError``, and so does a step that makes no progress for longer than
``HealthConfig.step_bound`` (``--execute-model-timeout``, or ten times the longest step
measured so far, at least 60 s): a worker that still ticks but is stuck. Progress is
what the workers' progress counters show (``aserve.process.heartbeat.Progress``: a
layer done), and for workers on other nodes their progress pings
(``RemoteWorkers.progress``): while either moves, the bound counts again from the move,
so a step of any length that keeps finishing layers, here or on another node, is waited
for.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time

import msgspec
import zmq

from aserve.config import EngineConfig
from aserve.distributed.shm_ring import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, RingClosedError, ShmRingReader, ShmRingWriter
from aserve.distributed.remote_workers import RemoteWorkers
from aserve.errors import EngineDeadError
from aserve.process.heartbeat import HeartbeatMonitor, HeartbeatTable, worker_slot
from aserve.process.instance import Instance
from aserve.process.stop import stop_processes
from aserve.process.utils import skip_resource_tracker
from aserve.wire.worker_messages import (
    REPLY_DECODER, GrammarMasks, RunnerOutput, SchedulerOutput, WorkerCall, WorkerMethod, WorkerReply,
)
from aserve.worker.worker_process import WorkerProcConfig, run_worker, worker_title

logger = logging.getLogger("aserve.executor")

_POLL = 1.0
#: Seconds a utility call (sleep, wake_up with a reload of the weights, a profile) may take.
UTILITY_TIMEOUT = 600.0


class MultiprocExecutor:
    """Workers run steps in the order written; the engine may write a second step before
    reading the first one's output (asynchronous scheduling, see ``EngineCore.step``)."""

    max_inflight = 2

    def __init__(self, config: EngineConfig, *, instance: Instance, dp_rank: int = 0, dp_size: int = 1,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, heartbeat_name: str | None = None,
                 secret: bytes | None = None) -> None:
        """``config`` is fitted. Waits up to ``config.health.startup_timeout`` for every
        worker's READY (its model loaded), those of other nodes included when the engine
        spans several (``secret``: their wires' CURVE secret)."""
        parallel = config.parallel
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        self.output_rank = parallel.output_rank
        self.local_ranks = parallel.local_ranks  # the head's: 0 .. workers_per_node - 1
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._remote: RemoteWorkers | None = None
        rendezvous = None
        if parallel.nnodes > 1:
            host = f"[{parallel.master_addr}]" if ":" in parallel.master_addr else parallel.master_addr
            rendezvous = f"tcp://{host}:{parallel.master_port}"
            self._remote = RemoteWorkers(self._ctx, master_addr=parallel.master_addr, master_port=parallel.master_port,
                                         ranks=[r for r in range(self.world_size) if r not in self.local_ranks],
                                         secret=secret)
        prefix = instance.segment(f"dp{dp_rank}")
        self._broadcast = ShmRingWriter(f"{prefix}_bcast", len(self.local_ranks),
                                        side_channel_address=instance.ipc(f"dp{dp_rank}_bcast"),
                                        zmq_context=self._ctx, max_chunk_bytes=max_chunk_bytes)
        self._response_names = {rank: f"{prefix}_resp{rank}" for rank in self.local_ranks}
        self._tp_shm_name = f"{prefix}_tp"
        # The TP collectives' segments: one per stage with pipeline stages.
        self._tp_shm_names = ([self._tp_shm_name] if self.pp_size == 1
                              else [f"{self._tp_shm_name}_pp{s}" for s in range(self.pp_size)])
        self._responses: dict[int, ShmRingReader] = {}
        self.workers: list[mp.process.BaseProcess] = []
        self._closed = False
        self._heartbeats: HeartbeatTable | None = None
        self._monitor: HeartbeatMonitor | None = None
        self._progress_slots: list[int] = []  # the local workers' heartbeat slots
        self._progress_seen = 0  # the sum of their progress counters at the last look
        self._health = config.health
        self._submitted: list[float] = []  # when each step in flight was written
        self._last_done = 0.0  # when the last step's output was read
        self.longest_step = 0.0  # seconds: the longest a step has taken (from when it could start)
        skip_resource_tracker()
        spawn = mp.get_context("spawn")
        try:
            for rank in self.local_ranks:
                cfg = WorkerProcConfig(
                    engine=config, rank=rank, tp_size=self.tp_size, pp_size=self.pp_size, dp_rank=dp_rank,
                    dp_size=dp_size, first_local_rank=self.local_ranks.start, local_count=len(self.local_ranks),
                    rendezvous=rendezvous,
                    broadcast_name=f"{prefix}_bcast", broadcast_side=instance.ipc(f"dp{dp_rank}_bcast"),
                    response_name=self._response_names[rank], response_side=instance.ipc(f"dp{dp_rank}_resp{rank}"),
                    dist_init_file=f"{instance.dir}/dist_dp{dp_rank}", tp_shm_name=self._tp_shm_name, max_chunks=DEFAULT_MAX_CHUNKS,
                    max_chunk_bytes=max_chunk_bytes, heartbeat_name=heartbeat_name,
                )
                proc = spawn.Process(target=run_worker, args=(cfg,), name=worker_title(cfg).removeprefix("aserve::"))
                proc.start()
                self.workers.append(proc)
            deadline = time.monotonic() + config.health.startup_timeout
            if heartbeat_name is not None:
                # Each worker ticks from a thread from its start (its load included): a
                # stopped one fails whatever waits on it, as one that exited does.
                world = self.world_size
                self._heartbeats = HeartbeatTable(heartbeat_name, worker_slot(dp_rank, world, world - 1) + 1,
                                                  create=False)
                slots = {worker_slot(dp_rank, world, r): f"worker {self._name(r)}" for r in self.local_ranks}
                self._progress_slots = list(slots)
                self._monitor = HeartbeatMonitor(self._heartbeats, slots, config.health.heartbeat_timeout)
            for rank in self.local_ranks:
                self._responses[rank] = self._attach(rank, instance, dp_rank, max_chunk_bytes, deadline)
            self._broadcast.wait_for_readers(timeout=max(1.0, deadline - time.monotonic()))
            for rank in range(self.world_size):  # each worker's READY, after its model loaded (remote ones too)
                self._read_reply(rank, deadline)
        except BaseException:
            self.shutdown()
            raise

    def _name(self, rank: int) -> str:
        """``tp1``, or ``pp1_tp0`` with pipeline stages: how errors name a worker."""
        return f"pp{rank // self.tp_size}_tp{rank % self.tp_size}" if self.pp_size > 1 else f"tp{rank}"

    def _attach(self, rank: int, instance: Instance, dp_rank: int, max_chunk_bytes: int, deadline: float) -> ShmRingReader:
        sleep = 0.001
        while True:
            self._check_workers()
            try:
                # The worker wakes us after every reply: sleep through the step on the
                # side channel rather than waking up to look (see ShmRingWriter).
                return ShmRingReader(self._response_names[rank], 0, 1,
                                     side_channel_address=instance.ipc(f"dp{dp_rank}_resp{rank}"),
                                     zmq_context=self._ctx, max_chunk_bytes=max_chunk_bytes, deep_sleep_after=0.0)
            except RingClosedError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {rank} did not start") from None
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.05)

    def _check_workers(self) -> None:
        if self._remote is not None:
            self._remote.check()
        for rank, proc in zip(self.local_ranks, self.workers):
            if proc.exitcode is not None:
                raise EngineDeadError(f"worker {self._name(rank)} exited with code {proc.exitcode}")
        if self._monitor is not None:
            stale = self._monitor.check(time.monotonic())
            if stale:
                raise EngineDeadError(f"{stale[0]} stopped responding (no heartbeat for {self._monitor.timeout:.0f} s)")

    def _read_reply(self, rank: int, deadline: float, renew: float | None = None) -> RunnerOutput | None:
        reply = self._read(rank, deadline, renew)
        if not reply.ok:
            raise EngineDeadError(f"worker {self._name(rank)} failed: {reply.error}")
        return reply.output

    def _progressed(self) -> bool:
        """Whether any local worker's progress counter, or the remote workers' count of
        progress pings, moved since the last look."""
        seen = 0
        if self._heartbeats is not None:
            seen += sum(self._heartbeats.progress(slot) for slot in self._progress_slots)
        if self._remote is not None:
            seen += self._remote.progress()
        moved, self._progress_seen = seen != self._progress_seen, seen
        return moved

    def _read(self, rank: int, deadline: float, renew: float | None = None) -> WorkerReply:
        """The next reply of ``rank``; ``EngineDeadError`` past ``deadline``, which
        moves to ``renew`` seconds after each look (once a second) that finds a worker's
        progress counter moved, when ``renew`` is given."""
        ring = self._responses.get(rank)
        if renew is not None:
            self._progressed()  # what the counters hold now: only a move from here counts
        while True:
            try:
                timeout = min(_POLL, max(0.0, deadline - time.monotonic()))
                if ring is None:
                    assert self._remote is not None
                    return REPLY_DECODER.decode(self._remote.read(rank, timeout))
                return REPLY_DECODER.decode(ring.read(timeout=timeout))
            except TimeoutError:
                self._check_workers()
                if renew is not None and self._progressed():
                    deadline = max(deadline, time.monotonic() + renew)
                if time.monotonic() >= deadline:
                    raise EngineDeadError(f"worker {self._name(rank)} gave no answer in time") from None

    def collective_rpc(self, method: WorkerMethod, arg: int | str | None = None, *,
                       timeout: float = UTILITY_TIMEOUT) -> str | None:
        """Run a worker utility (sleep, wake_up, start_profile, stop_profile) on every
        rank, in step order (the engine core calls it with no step in flight); rank 0's
        result, or RuntimeError with its error (the workers go on). ``EngineDeadError``
        past ``timeout`` or if a worker dies meanwhile."""
        deadline = time.monotonic() + timeout
        self._write(WorkerCall(method, output_rank=0, arg=arg), deadline)
        reply = self._read(0, deadline)
        if not reply.ok:
            raise RuntimeError(reply.error)
        return reply.result

    def submit_model(self, sched: SchedulerOutput) -> None:
        self._write(WorkerCall("execute_model", sched, output_rank=self.output_rank),
                    time.monotonic() + self._health.step_bound(self.longest_step))
        self._submitted.append(time.monotonic())

    def submit_masks(self, masks: GrammarMasks) -> None:
        """The grammar masks of the oldest step in flight, behind it on the ring: the
        ranks that sample read them before they sample (``SchedulerOutput.masks_follow``)."""
        deadline = time.monotonic() + self._health.step_bound(self.longest_step)
        self._write(WorkerCall("grammar_masks", masks=masks), deadline)

    def wait_model(self) -> RunnerOutput:
        """The output of the oldest step written and not yet read; ``EngineDeadError``
        once it has made no progress for the step bound (counted from when the workers
        could start it: its write, or the end of the step before it; and again from each
        move of a local worker's progress counter)."""
        began = max(self._submitted.pop(0), self._last_done) if self._submitted else time.monotonic()
        bound = self._health.step_bound(self.longest_step)
        try:
            output = self._read_reply(self.output_rank, began + bound, renew=bound)
        except EngineDeadError as exc:
            if "gave no answer in time" in str(exc):
                raise EngineDeadError(f"a model step made no progress for {bound:.0f} s (the workers still tick: "
                                      "stuck, not stopped; --execute-model-timeout sets the bound)") from None
            raise
        self._last_done = time.monotonic()
        self.longest_step = max(self.longest_step, self._last_done - began)
        assert output is not None
        return output

    def _write(self, call: WorkerCall, deadline: float) -> None:
        payload = self._encoder.encode(call)
        if self._remote is not None:
            self._remote.publish(payload)
        while True:
            try:
                self._broadcast.write(payload, timeout=min(_POLL, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                self._check_workers()
                if time.monotonic() >= deadline:
                    raise EngineDeadError("workers stopped reading the broadcast ring") from None

    def shutdown(self) -> None:
        """Stop the workers (asking first, then SIGTERM, then SIGKILL) and remove the rings."""
        if self._closed:
            return
        self._closed = True
        if all(p.exitcode is None for p in self.workers) and self.workers:
            try:
                if self._remote is not None:
                    self._remote.publish(self._encoder.encode(WorkerCall("shutdown")))
                self._broadcast.write(self._encoder.encode(WorkerCall("shutdown")), timeout=1.0)
            except (TimeoutError, OSError):
                pass
        stop_processes(self.workers, asked_first=5, grace=5)
        if self._heartbeats is not None:
            self._heartbeats.close()
        for ring in self._responses.values():
            ring.close()
        if self._remote is not None:
            self._remote.close()
        self._broadcast.close()
        # A worker killed hard could not unlink its own ring; rank 0 unlinks the TP segment
        # as soon as every rank mapped it, unless it was killed before that.
        for name in [*self._response_names.values(), *self._tp_shm_names]:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        self._ctx.term()
