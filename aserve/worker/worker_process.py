"""A worker process: one rank of one engine: a TP rank of one pipeline stage (docs/design.md §3, §6, §16).

Start-up: attach to the engine core's broadcast ring, create this rank's response ring,
join the engine's process group (gloo on CPU; with ``tp_comm="shm"`` it sets up the
shared-memory collectives, and is then released unless pipeline stages still need it
for their point-to-point traffic), load this rank's shard and KV cache, then tell
the executor it is ready through the response ring. After that the process only
dequeues calls from the ring and runs them; every rank runs every call, and only the
call's ``output_rank`` writes the reply. The worker unlinks its response ring on every
exit path, and exits when its parent does.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import zmq

from aserve.config import EngineConfig
from aserve.distributed.shm_ring import ShmRingReader, ShmRingWriter
from aserve.envs import read_env
from aserve.wire.worker_messages import CALL_DECODER, GrammarMasks, WorkerCall, WorkerReply
from aserve.process.heartbeat import Heartbeat, HeartbeatTable, Progress, worker_slot
from aserve.process.utils import (
    available_cores,
    exit_with_parent,
    ignore_termination,
    interrupt_on_termination,
    pin_to_cpus,
    set_process_title,
)

logger = logging.getLogger("aserve.worker")


@dataclass(frozen=True)
class WorkerProcConfig:
    engine: EngineConfig  # fitted
    rank: int  # in the engine: stage rank // tp_size, TP rank rank % tp_size
    tp_size: int
    dp_rank: int
    dp_size: int
    broadcast_name: str
    broadcast_side: str
    response_name: str
    response_side: str
    dist_init_file: str
    tp_shm_name: str  # the shared-memory collectives' segment, when tp_comm is "shm"
    max_chunks: int
    max_chunk_bytes: int
    heartbeat_name: str | None = None
    pp_size: int = 1
    # An engine across nodes (aserve.distributed.remote_workers): this node's first rank
    # (its ring reader index is rank - first_local_rank), the rendezvous (tcp://, else
    # the dist_init_file), and for a worker on a node without the engine core, the
    # head's call and reply addresses and the CURVE secret instead of the rings.
    first_local_rank: int = 0
    local_count: int | None = None
    rendezvous: str | None = None
    remote_calls: str | None = None
    remote_replies: str | None = None
    secret: bytes | None = None

    @property
    def world_size(self) -> int:
        """Workers of this engine."""
        return self.tp_size * self.pp_size

    @property
    def ring_readers(self) -> int:
        """Workers of this engine on this node: the broadcast ring's readers."""
        return self.world_size if self.local_count is None else self.local_count

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


def worker_title(cfg: WorkerProcConfig) -> str:
    """``aserve::worker_tp1``; ``aserve::worker_dp1_tp0`` with data parallelism;
    ``aserve::worker_pp1_tp0`` (``..._dp0_pp1_tp0``) with pipeline stages."""
    dp = f"dp{cfg.dp_rank}_" if cfg.dp_size > 1 else ""
    pp = f"pp{cfg.pp_rank}_" if cfg.pp_size > 1 else ""
    return f"aserve::worker_{dp}{pp}tp{cfg.tp_rank}"


def run_worker(cfg: WorkerProcConfig) -> None:
    """Process entry point (a ``spawn`` target)."""
    set_process_title(worker_title(cfg))
    pin_to_cpus(cfg.engine.parallel.worker_cpus(cfg.dp_rank, cfg.rank), all_threads=True)
    interrupt_on_termination()
    exit_with_parent()
    logging.basicConfig(level=read_env().log_level,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    import torch

    torch.set_num_threads(cfg.engine.parallel.threads_per_worker(available_cores()))
    ctx = zmq.Context()
    broadcast = response = None
    code = 0
    table = heartbeat = progress = None
    if cfg.heartbeat_name is not None:
        slot = worker_slot(cfg.dp_rank, cfg.world_size, cfg.rank)
        table = HeartbeatTable(cfg.heartbeat_name, slot + 1, create=False)
        # From before the model loads: a slow load still ticks, a stopped process does not.
        heartbeat = Heartbeat(table, slot).__enter__()
        progress = Progress(table, slot)
    try:
        if cfg.remote_calls is not None:
            assert cfg.remote_replies is not None
            from aserve.distributed.remote_workers import CallSubscriber, ReplyPusher

            broadcast = CallSubscriber(ctx, cfg.remote_calls, cfg.secret)
            response = ReplyPusher(ctx, cfg.remote_replies, cfg.rank, cfg.secret)
            broadcast.wait_connected(cfg.engine.health.startup_timeout)
        else:
            broadcast = ShmRingReader(cfg.broadcast_name, cfg.rank - cfg.first_local_rank, cfg.ring_readers,
                                      side_channel_address=cfg.broadcast_side, zmq_context=ctx,
                                      max_chunks=cfg.max_chunks, max_chunk_bytes=cfg.max_chunk_bytes)
            response = ShmRingWriter(cfg.response_name, 1, side_channel_address=cfg.response_side, zmq_context=ctx,
                                     max_chunks=cfg.max_chunks, max_chunk_bytes=cfg.max_chunk_bytes,
                                     wake_every_write=True)
        _serve(cfg, broadcast, response, progress)
    except KeyboardInterrupt:
        pass
    except BaseException:
        logger.exception("worker %s failed", worker_title(cfg))
        code = 1
    finally:
        ignore_termination()
        if heartbeat is not None:
            heartbeat.__exit__(None, None, None)
        if table is not None:
            table.close()
        if broadcast is not None:
            broadcast.close()
        if response is not None:
            response.close()
        ctx.term()
    sys.exit(code)


def _serve(cfg: WorkerProcConfig, broadcast: ShmRingReader, response: ShmRingWriter,
           progress: Progress | None) -> None:
    """Build the worker and answer calls; ``progress``: advanced after every layer of a
    step (the engine core then sees a long step as slow, not stuck). A worker on another
    node has none; its reply socket's progress pings tell the head instead."""
    # torch and the model are imported here, in the worker, not at module level: the
    # engine core imports this module for its entry point and stays torch-free.
    import torch.distributed as dist

    from aserve.distributed.tp_group import TPGroup
    from aserve.worker.worker import Worker

    device = None
    if cfg.engine.model.device == "cuda":
        import torch

        from aserve.devices import worker_device_index

        # Set before the TP group forms: NCCL binds each rank to the current device.
        index = worker_device_index(cfg.engine.parallel.local_worker_index(cfg.dp_rank, cfg.rank),
                                    torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    if cfg.rendezvous is not None:
        logger.info("rank %d: joining the engine's process group at %s", cfg.rank, cfg.rendezvous)
    tp, pp = TPGroup.single(), None
    if cfg.pp_size > 1:
        tp, pp = _join_stage_groups(cfg, device)
    elif cfg.tp_size > 1:
        tp = _join_tp_group(cfg, device)
    try:
        worker = Worker(cfg.engine, tp, show_progress=cfg.rank == 0 and cfg.dp_rank == 0, dp_rank=cfg.dp_rank, pp=pp)
        if progress is not None:
            worker.runner.layer_done = progress.advance
        elif cfg.remote_calls is not None:  # a worker on another node: pings over its reply socket
            worker.runner.layer_done = response.layer_done
        _serve_calls(cfg, worker, broadcast, response)
    finally:
        if tp.comm is not None:
            tp.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_tp_group(cfg: WorkerProcConfig, device):  # -> TPGroup (torch is imported lazily)
    """This rank's TP group: NCCL on CUDA (``device``, this rank's GPU), gloo on either,
    or on CPU shared memory set up over gloo, which is then released so that no gloo
    thread wakes up on an idle server (docs/parallelism.md)."""
    import torch
    import torch.distributed as dist

    from aserve.distributed.shm_comm import ShmCommunicator, load_collectives
    from aserve.distributed.tp_group import TPGroup

    tp_comm = cfg.engine.parallel.tp_comm
    init = dict(init_method=cfg.rendezvous or f"file://{cfg.dist_init_file}", rank=cfg.rank, world_size=cfg.tp_size,
                timeout=timedelta(seconds=cfg.engine.health.startup_timeout))
    if tp_comm == "nccl":
        # device_id binds the communicator to this GPU at once (no lazy init on the
        # first collective, which would then also pay NCCL's set-up inside a step).
        dist.init_process_group("nccl", device_id=device, **init)
        return TPGroup(cfg.rank, cfg.tp_size, dist.group.WORLD)
    dist.init_process_group("gloo", **init)
    if tp_comm == "gloo":
        return TPGroup(cfg.rank, cfg.tp_size, dist.group.WORLD)
    lib = load_collectives(read_env().cache_dir / "kernels")
    # Every rank must make the same choice: a rank without the library says so to all
    # (a MIN over a tensor, not all_gather_object, which would unpickle).
    built = torch.tensor([int(lib is not None)])
    dist.all_reduce(built, op=dist.ReduceOp.MIN)
    if not built.item():
        logger.warning("shared-memory collectives unavailable on some rank: tensor parallelism uses gloo")
        return TPGroup(cfg.rank, cfg.tp_size, dist.group.WORLD)
    comm = ShmCommunicator(lib, cfg.tp_shm_name, cfg.rank, cfg.tp_size, barrier=dist.barrier)
    dist.destroy_process_group()
    return TPGroup(cfg.rank, cfg.tp_size, comm=comm)


def _join_stage_groups(cfg: WorkerProcConfig, device):  # -> (TPGroup, PPGroup)
    """The engine's process group of every worker, kept for the stages' point-to-point
    traffic (gloo on CPU, NCCL on CUDA), and this stage's TP group inside it: a
    subgroup, or on CPU the shared-memory collectives (a segment per stage), set up
    over it."""
    import torch
    import torch.distributed as dist

    from aserve.distributed.pp_group import PPGroup
    from aserve.distributed.shm_comm import ShmCommunicator, load_collectives
    from aserve.distributed.tp_group import TPGroup

    tp_comm = cfg.engine.parallel.tp_comm
    init = dict(init_method=cfg.rendezvous or f"file://{cfg.dist_init_file}", rank=cfg.rank,
                world_size=cfg.world_size, timeout=timedelta(seconds=cfg.engine.health.startup_timeout))
    if tp_comm == "nccl":
        dist.init_process_group("nccl", device_id=device, **init)
    else:
        dist.init_process_group("gloo", **init)
    pp = PPGroup(cfg.pp_rank, cfg.pp_size, cfg.tp_rank, cfg.tp_size, dist.group.WORLD)
    # Every rank creates every stage's subgroup, in the same order (new_group's rule).
    stage_groups = [dist.new_group(list(range(s * cfg.tp_size, (s + 1) * cfg.tp_size)))
                    for s in range(cfg.pp_size)]
    group = stage_groups[cfg.pp_rank]
    if cfg.tp_size == 1:
        return TPGroup.single(), pp
    if tp_comm == "shm":
        lib = load_collectives(read_env().cache_dir / "kernels")
        built = torch.tensor([int(lib is not None)])  # every rank makes the same choice
        dist.all_reduce(built, op=dist.ReduceOp.MIN)
        if built.item():
            comm = ShmCommunicator(lib, f"{cfg.tp_shm_name}_pp{cfg.pp_rank}", cfg.tp_rank, cfg.tp_size,
                                   barrier=lambda: dist.barrier(group=group))
            return TPGroup(cfg.tp_rank, cfg.tp_size, comm=comm), pp
        logger.warning("shared-memory collectives unavailable: tensor parallelism uses gloo")
    return TPGroup(cfg.tp_rank, cfg.tp_size, group), pp


def _serve_calls(cfg: WorkerProcConfig, worker, broadcast: ShmRingReader, response: ShmRingWriter) -> None:
    encoder = msgspec.msgpack.Encoder()
    response.wait_for_readers(timeout=300)
    response.write(encoder.encode(WorkerReply(ok=True)))
    # Every method a call may name; nothing else is reachable from the ring.
    utilities = {"sleep": worker.sleep, "wake_up": worker.wake_up, "start_profile": worker.start_profile,
                 "stop_profile": worker.stop_profile}
    # Calls read ahead while a step waited for its grammar masks (with pipeline stages the
    # engine may write the next step first), taken before the ring's next.
    ahead: deque[WorkerCall] = deque()

    def fetch_masks() -> GrammarMasks:
        """The grammar masks the step in progress asked for (``masks_follow``)."""
        while True:
            call: WorkerCall = CALL_DECODER.decode(broadcast.read())
            if call.method == "grammar_masks":
                assert call.masks is not None
                return call.masks
            if call.method == "shutdown":
                raise _Shutdown
            ahead.append(call)

    worker.runner.fetch_masks = fetch_masks
    while True:
        call = ahead.popleft() if ahead else CALL_DECODER.decode(broadcast.read())
        if call.method == "shutdown":
            return
        if call.method == "grammar_masks":
            if worker.runner.samples:  # its step reads them: here they would be out of order
                raise RuntimeError("grammar masks arrived with no step waiting for them")
            continue  # a pipeline stage before the last: masks are for the last stage
        try:
            if call.method == "execute_model":
                reply = WorkerReply(ok=True, output=worker.execute_model(call.sched))
            else:
                result = utilities[call.method](*(() if call.arg is None else (call.arg,)))
                reply = WorkerReply(ok=True, result=None if result is None else str(result))
        except _Shutdown:
            return  # the engine stopped while this step waited for its masks
        except Exception as exc:
            logger.exception("%s failed", call.method)
            reply = WorkerReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        if cfg.rank == call.output_rank:
            response.write(encoder.encode(reply))
        if not reply.ok and call.method == "execute_model":
            raise RuntimeError(reply.error)  # a failed step ends the worker; a failed utility call does not


class _Shutdown(Exception):
    """The engine's shutdown call, read while a step waited for its grammar masks."""
