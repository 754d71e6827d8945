"""A node of an engine that spans machines and runs only workers.

    aserve run MODEL --tp 2 --nnodes 2 --node-rank 1 --master-addr HEAD --headless

The head (``--node-rank 0``) runs the API servers, the engine core and the workers of
ranks ``0 .. W/n - 1``; node ``k`` runs the workers of ranks ``k * W/n`` onwards. Each of
them joins the engine's ``torch.distributed`` group at ``master_addr:master_port`` and
takes the engine core's calls from the head's publisher, replying on the head's reply
socket (``aserve.distributed.remote_workers``).

This process (``aserve::supervisor`` of the node) starts the node's workers and watches
two things, sleeping between events (a socket event or a second's tick to look at the
workers): the head, through a connection of its own to the head's publisher, and its
workers (:func:`watch`). When the head goes (the connection, once made, drops) it stops
the workers: SIGTERM, then SIGKILL for one stuck in a rendezvous that no longer has a
head, which is how vLLM's headless nodes hang (vLLM #32136). It exits 0 when the head
stopped the engine cleanly (every worker was told to shut down and exited 0), non-zero
otherwise. A worker told to shut down may exit before the head's connection drops (the
head stops its own workers first): its exit 0 is taken as the head's stop once the
connection drops. When a worker dies (a non-zero exit, or an exit 0 with the head still
there 15 s later) the node stops the others and exits non-zero; the head sees the
workers' connections drop and takes its engine down.
A secret that differs from the head's fails the CURVE handshake: the node says so and
exits. Nothing is left behind: the node's instance (its TP segments; it has no IPC
directory, so a SIGKILL of this process leaves none) is removed on every exit path.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections.abc import Callable

import zmq

from aserve.distributed.remote_workers import CallSubscriber, HeadLostError, call_address, reply_address
from aserve.distributed.shm_ring import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
from aserve.engine.fit import FittedConfig
from aserve.launch.common import configure_logging
from aserve.process.instance import Instance
from aserve.process.stop import stop_processes
from aserve.process.utils import set_process_title, skip_resource_tracker
from aserve.worker.worker_process import WorkerProcConfig, run_worker, worker_title

logger = logging.getLogger("aserve.node")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:  # noqa: ANN001
    raise _Stop


#: Seconds a node waits, after a worker exited 0, for the head's connection to drop. A
#: worker exits 0 when the head's engine core tells it to shut down, and the head closes
#: its publisher only after stopping its own workers (``MultiprocExecutor.shutdown``: 5 s
#: to exit when asked, then 5 s after SIGTERM), so a node may see its worker's exit first.
HEAD_STOP_WAIT = 15.0


def watch(head: CallSubscriber, workers: list[mp.process.BaseProcess], *, tick: float = 1.0,
          head_stop_wait: float = HEAD_STOP_WAIT, clock: Callable[[], float] = time.monotonic) -> bool:
    """Sleep until the head goes or a worker exits (``head.wait_event`` wakes on the
    connection's events and every ``tick`` seconds to look at the workers). True when the
    head went, with or after workers that exited 0 (a clean stop of the engine): the
    caller lets the rest exit on their own. False when a worker failed (a non-zero exit
    code), or exited 0 while the head stayed for ``head_stop_wait`` s (a worker stopped
    by hand): the caller stops the node."""
    first_clean_exit = None
    while True:
        try:
            head.wait_event(tick)
        except HeadLostError as exc:
            logger.info("%s: stopping this node's workers", exc)
            return True
        dead = [p for p in workers if p.exitcode is not None]
        failed = [p for p in dead if p.exitcode != 0]
        if failed:
            logger.error("worker %s exited with code %s: stopping this node", failed[0].name, failed[0].exitcode)
            return False
        if dead:
            # Most likely the head told it to shut down and is stopping its own workers
            # before it closes the connection this process watches.
            if first_clean_exit is None:
                first_clean_exit = clock()
            elif clock() - first_clean_exit > head_stop_wait:
                logger.error("worker %s exited, and the head is still there %.0f s later: stopping this node",
                             dead[0].name, head_stop_wait)
                return False


def run_worker_node(fitted: FittedConfig, secret: bytes | None, log_level: str = "INFO") -> int:
    """Run this node's workers until the head goes, a worker dies, or SIGTERM/SIGINT.
    Returns the exit code: 0 for SIGTERM/SIGINT or the head's clean stop."""
    configure_logging(log_level)
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    config = fitted.config
    parallel = config.parallel
    instance = Instance.create(ipc=False)  # its workers talk to the head over TCP
    spawn = mp.get_context("spawn")
    ctx = zmq.Context()
    workers: list[mp.process.BaseProcess] = []
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    host = f"[{parallel.master_addr}]" if ":" in parallel.master_addr else parallel.master_addr
    calls = call_address(parallel.master_addr, parallel.master_port)
    # This process's own view of the head: a connection to its publisher that subscribes
    # to nothing (no call is queued here), watched for the handshake and for its drop.
    head = CallSubscriber(ctx, calls, secret, subscribe=False)
    code = 1
    head_gone = False
    try:
        head.wait_connected(config.health.startup_timeout)
        for rank in parallel.local_ranks:
            cfg = WorkerProcConfig(
                engine=config, rank=rank, tp_size=parallel.tensor_parallel_size,
                pp_size=parallel.pipeline_parallel_size, dp_rank=0, dp_size=1, broadcast_name="",
                broadcast_side="", response_name="", response_side="", dist_init_file="",
                tp_shm_name=instance.segment("dp0_tp"), max_chunks=DEFAULT_MAX_CHUNKS,
                max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES, first_local_rank=parallel.local_ranks.start,
                local_count=len(parallel.local_ranks), rendezvous=f"tcp://{host}:{parallel.master_port}",
                remote_calls=calls, remote_replies=reply_address(parallel.master_addr, parallel.master_port),
                secret=secret,
            )
            proc = spawn.Process(target=run_worker, args=(cfg,), name=worker_title(cfg).removeprefix("aserve::"))
            proc.start()
            workers.append(proc)
        print(f"aserve: node {parallel.node_rank} of {parallel.nnodes}: workers of ranks "
              f"{parallel.local_ranks.start}..{parallel.local_ranks.stop - 1} joined {calls}", flush=True)
        head_gone = watch(head, workers)
    except HeadLostError as exc:
        logger.error("%s", exc)
    except TimeoutError as exc:
        logger.error("%s within %.0f s at %s", exc, config.health.startup_timeout, calls)
    except _Stop:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # When the head went, its workers may be exiting on their own (a clean stop
        # sends them "shutdown"): they get a few seconds first. A worker blocked in a
        # rendezvous with no head cannot act on SIGTERM: it is killed after the grace.
        stop_processes(workers, grace=5, asked_first=5 if head_gone else 0)
        if head_gone and workers and all(p.exitcode == 0 for p in workers):
            print(f"aserve: node {parallel.node_rank}: the head stopped the engine", flush=True)
            code = 0  # a clean stop of the whole engine, not a failure of this node
        head.close()
        ctx.term()
        instance.cleanup()
    return code
