"""The front-end node of ``aserve run``: API servers, the DP coordinator and the local
engines, started from one fitted config on a socket that is already listening.

On one machine every wire is an ``ipc://`` file in the instance's private directory.
When some engines run on headless nodes (``--dp-size-local`` < ``--dp``), the API
servers and the coordinator bind ``tcp://--dp-address:0`` (CURVE-authenticated by the
DP secret) and report the ports the kernel gave them; the supervisor then answers
headless nodes' handshakes on ``--dp-address:--dp-rpc-port`` with those addresses.
See ``aserve.launch.supervisor`` for what brings the tree down and how.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import socket
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from aserve.api import admission
from aserve.api.server import DEAD_ENGINE_GRACE, ApiServerConfig, run_api_server
from aserve.config import ParallelConfig
from aserve.engine.fit import FittedConfig
from aserve.engine.spawn import create_heartbeats, spawn_coordinator, spawn_engine_cores
from aserve.frontend.core_client import EngineAttachment
from aserve.launch.common import DataParallelLaunch, Outcome, first_exit, first_signal
from aserve.process.instance import Instance
from aserve.process.stop import stop_processes, stop_processes_async
from aserve.process.utils import ignore_termination
from aserve.wire import handshake
from aserve.wire.addresses import WireAddresses, ipc_addresses, tcp_bind_address
from aserve.wire.codec import ENGINE_CORE_DEAD
from aserve.wire.sockets import open_socket
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.supervisor")

#: Seconds between two log lines about peers that fail the CURVE handshake.
REFUSAL_LOG_INTERVAL = 10.0
#: Seconds to wait for a child to report the ports it bound.
REPORT_TIMEOUT = 120.0


async def receive_report(reader: multiprocessing.connection.Connection, proc: mp.process.BaseProcess) -> list[str]:
    """The endpoints a child bound (tcp port 0), or an error if it exits first."""
    async def child_exit() -> None:
        await anyio.wait_readable(proc.sentinel)
        raise RuntimeError(f"{proc.name} exited (code {proc.exitcode}) before reporting its addresses")

    with anyio.fail_after(REPORT_TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(child_exit)
            await anyio.wait_readable(reader.fileno())
            endpoints = reader.recv()
            tg.cancel_scope.cancel()
    reader.close()
    return endpoints


class FrontEnd:
    def __init__(self, cfg: ApiServerConfig, sock: socket.socket, host: str, dp: DataParallelLaunch,
                 instance: Instance) -> None:
        """``sock``: the listening socket, bound; ``cfg.fitted``: the fitted engine config."""
        self.cfg, self.sock, self.host, self.dp, self.instance = cfg, sock, host, dp, instance
        self.api_count = dp.api_server_count or dp.size
        self.apis: list[mp.process.BaseProcess] = []
        self.engines: dict[int, mp.process.BaseProcess] = {}
        self.coordinator: mp.process.BaseProcess | None = None
        self.addresses: WireAddresses | None = None
        self.nodes: dict[bytes, range] = {}  # headless nodes that were welcomed: identity -> DP ranks

    async def run(self) -> int:
        cfg, dp = self.cfg, self.dp
        fitted, sock = cfg.fitted, self.sock
        world = fitted.config.parallel.world_size
        bound_port = sock.getsockname()[1]
        heartbeat_name = create_heartbeats(self.instance, world, range(dp.size))  # removed by Instance.cleanup
        if self.cfg.limits.admission.enabled:  # the API servers' shared counts, also removed by Instance.cleanup
            segment = admission.segment_name(self.instance.id)
            admission.create_segment(segment, self.api_count)
            self.cfg = dataclasses.replace(self.cfg, admission_segment=segment, admission_slots=self.api_count)
        local_ranks = range(dp.local)
        spawn = mp.get_context("spawn")
        ctx = zmq.Context()
        handshake_sock: AsyncSocket | None = None
        try:
            if not dp.multi_node:
                self.addresses = ipc_addresses(self.instance.dir, self.api_count, coordinator=dp.size > 1)
                if dp.size > 1:
                    self.coordinator = spawn_coordinator(dp.size, self.addresses)
                # The secret reaches the engine core for an engine across machines: its
                # executor's wires to the remote workers (aserve/distributed/remote_workers.py).
                self.engines = spawn_engine_cores(fitted, self.addresses, local_ranks, instance=self.instance,
                                                  heartbeat_name=heartbeat_name, secret=dp.secret)
                engine_pids = {rank: proc.pid for rank, proc in self.engines.items()}
                for i in range(self.api_count):
                    attach = EngineAttachment(self.instance, self.addresses, engine_pids, tuple(local_ranks),
                                              client_index=i)
                    self.apis.append(self._spawn_api(spawn, sock, i, attach, None))
            else:
                # The fixed handshake port first: the children's tcp://HOST:0 binds take
                # ports from the kernel's ephemeral range, which may hold it.
                handshake_sock = self._bind_handshake(ctx)
                await self._start_multi_node(spawn, sock, fitted, local_ranks, heartbeat_name)
            sock.close()  # the API servers hold their own copies
            self._announce(bound_port, fitted.config.parallel)

            outcome = Outcome()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_children, outcome, tg.cancel_scope)
                tg.start_soon(self._watch_signals, outcome, tg.cancel_scope)
                if handshake_sock is not None:
                    tg.start_soon(self._serve_nodes, handshake_sock, outcome, tg.cancel_scope)
            ignore_termination()
            with anyio.CancelScope(shield=True):
                return await self._shut_down(outcome, ctx, handshake_sock)
        finally:
            ignore_termination()
            if handshake_sock is not None:
                handshake_sock.close(linger=1000)  # let STOP reach the nodes
            ctx.term()
            # Start-up failed part-way, or anything is left.
            stop_processes([*self.apis, *self.engines.values(), *([self.coordinator] if self.coordinator else [])],
                           grace=30)

    def _spawn_api(self, spawn: Any, sock: socket.socket, index: int, attach: EngineAttachment,
                   report: Any) -> mp.process.BaseProcess:
        attach = dataclasses.replace(attach, report=report)
        api_cfg = dataclasses.replace(self.cfg, index=index, attach=attach)
        proc = spawn.Process(target=run_api_server, args=(api_cfg, sock), name=f"api_server_{index}")
        proc.start()
        return proc

    async def _start_multi_node(self, spawn: Any, sock: socket.socket, fitted: FittedConfig, local_ranks: range,
                                heartbeat_name: str) -> None:
        """TCP wires: the coordinator and API servers bind port 0 and report; then the
        local engines start with the addresses they reported."""
        dp, bind = self.dp, tcp_bind_address(self.dp.address)
        publish = self.instance.ipc("coordinator_publish")  # only this node's API servers subscribe
        coordinator_input = coordinator_stats = None
        if dp.size > 1:
            reader, writer = mp.Pipe(duplex=False)
            self.coordinator = spawn_coordinator(
                dp.size, WireAddresses((), (), bind, bind, publish), secret=dp.secret, report=writer)
            writer.close()
            coordinator_input, coordinator_stats, _ = await receive_report(reader, self.coordinator)
        binds = WireAddresses((bind,) * self.api_count, (bind,) * self.api_count,
                              coordinator_publish=publish if dp.size > 1 else None)
        readers = []
        for i in range(self.api_count):
            reader, writer = mp.Pipe(duplex=False)
            attach = EngineAttachment(self.instance, binds, {}, tuple(local_ranks), client_index=i, secret=dp.secret)
            self.apis.append(self._spawn_api(spawn, sock, i, attach, writer))
            writer.close()
            readers.append(reader)
        reports = [await receive_report(reader, proc) for reader, proc in zip(readers, self.apis)]
        self.addresses = WireAddresses(
            api_inputs=tuple(r[0] for r in reports), api_outputs=tuple(r[1] for r in reports),
            coordinator_input=coordinator_input, coordinator_stats=coordinator_stats,
            coordinator_publish=publish if dp.size > 1 else None,
        )
        self.engines = spawn_engine_cores(fitted, self.addresses, local_ranks, instance=self.instance,
                                          heartbeat_name=heartbeat_name, secret=dp.secret)

    def _bind_handshake(self, ctx: zmq.Context) -> AsyncSocket:
        host = f"[{self.dp.address}]" if ":" in self.dp.address else self.dp.address
        return open_socket(ctx, zmq.ROUTER, f"tcp://{host}:{self.dp.rpc_port}", bind=True, secret=self.dp.secret)

    def _announce(self, port: int, parallel: ParallelConfig) -> None:
        cfg, dp = self.cfg, self.dp
        scheme = "https" if cfg.ssl_certfile else "http"
        print(f"aserve: serving {cfg.served_model_name} at {scheme}://{self.host}:{port}/v1", flush=True)
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        workers = ", ".join(f"aserve::worker_{f'pp{r // tp}_' if pp > 1 else ''}tp{r % tp}" for r in parallel.local_ranks)
        engines = ", ".join(f"aserve::engine_core_{d} -> [{workers}]" for d in range(dp.local))
        apis = ", ".join(f"aserve::api_server_{i}" for i in range(self.api_count))
        coordinator = "aserve::coordinator, " if self.coordinator is not None else ""
        print(f"aserve: process tree: aserve::supervisor -> [{apis}, {coordinator}{engines}]", flush=True)
        if dp.local < dp.size:
            print(f"aserve: waiting for headless nodes with DP ranks {dp.local}..{dp.size - 1} on "
                  f"tcp://{dp.address}:{dp.rpc_port}", flush=True)

    # -- the watching tasks --------------------------------------------------------------

    async def _watch_children(self, outcome: Outcome, scope: anyio.CancelScope) -> None:
        procs = [*self.apis, *self.engines.values(), *([self.coordinator] if self.coordinator else [])]
        proc = await first_exit(procs)
        outcome.set(f"{proc.name} exited (code {proc.exitcode})", graceful=False, scope=scope)

    async def _watch_signals(self, outcome: Outcome, scope: anyio.CancelScope) -> None:
        signum = await first_signal()
        for api in self.apis:  # at once: /ready must turn 503 now
            if api.exitcode is None:
                api.terminate()
        outcome.set(f"signal {signal.Signals(signum).name}", graceful=True, scope=scope)

    async def _serve_nodes(self, router: AsyncSocket, outcome: Outcome, scope: anyio.CancelScope) -> None:
        """Answer headless nodes' handshakes; a node's FAILED brings the tree down."""
        dp = self.dp
        decoder = msgspec.msgpack.Decoder(handshake.NodeHello)
        taken: set[int] = set()

        async def log_refused_peers() -> None:
            events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | \
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            monitor = AsyncSocket(router.socket.get_monitor_socket(events))
            last_logged, suppressed = -REFUSAL_LOG_INTERVAL, 0
            try:
                while True:
                    await monitor.recv_multipart()
                    # A refused peer reconnects every 100 ms until it gives up: log once
                    # per interval, not once per attempt.
                    now = anyio.current_time()
                    if now - last_logged < REFUSAL_LOG_INTERVAL:
                        suppressed += 1
                        continue
                    logger.warning("refused a peer on tcp://%s:%d: it failed the CURVE handshake (wrong DP secret?)%s",
                                   dp.address, dp.rpc_port, f" ({suppressed} more attempts)" if suppressed else "")
                    last_logged, suppressed = now, 0
            finally:
                router.socket.disable_monitor()
                monitor.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(log_refused_peers)
            while True:
                frames = await router.recv_multipart()
                if len(frames) < 2:
                    continue
                identity, kind = frames[0], frames[1]
                if kind == handshake.HELLO and len(frames) == 3:
                    try:
                        hello = decoder.decode(frames[2])
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        logger.warning("dropped a malformed HELLO from a node")
                        continue
                    reason = handshake.check_hello(hello, dp_size=dp.size, first_remote_rank=dp.local,
                                                   tp_size=self.cfg.fitted.config.parallel.tensor_parallel_size,
                                                   pp_size=self.cfg.fitted.config.parallel.pipeline_parallel_size,
                                                   model_name=self.cfg.served_model_name, taken=taken)
                    if reason is not None:
                        logger.warning("refused a headless node: %s", reason)
                        router.send_nowait([identity, handshake.REFUSED, reason.encode()])
                        continue
                    ranks = range(hello.start_rank, hello.start_rank + hello.local_size)
                    taken.update(ranks)
                    self.nodes[identity] = ranks
                    router.send_nowait([identity, handshake.WELCOME, msgspec.msgpack.encode(self.addresses)])
                    logger.info("a headless node joined with DP ranks %d..%d", ranks.start, ranks.stop - 1)
                elif kind == handshake.FAILED and identity in self.nodes:
                    ranks = self.nodes[identity]
                    why = bytes(frames[2]).decode(errors="replace") if len(frames) > 2 else "no reason given"
                    outcome.set(f"the headless node with DP ranks {ranks.start}..{ranks.stop - 1} failed: {why}",
                                graceful=False, scope=scope)
                    return

    # -- shutting down ---------------------------------------------------------------------

    async def _shut_down(self, outcome: Outcome, ctx: zmq.Context, handshake_sock: AsyncSocket | None) -> int:
        others = [*self.engines.values(), *([self.coordinator] if self.coordinator else [])]
        if outcome.graceful:
            logger.info("stopping (%s): draining the API servers", outcome.reason)
            # Drain: the API servers finish (or abort) their requests, then the engines stop.
            await stop_processes_async(self.apis, asked_first=self.cfg.shutdown_timeout + 60, grace=30)
            self._stop_nodes(handshake_sock)
            await stop_processes_async(others, grace=60)
            return 0
        logger.error("%s; stopping the server", outcome.reason)
        asked = 0.0
        if any(api.exitcode is None for api in self.apis):
            # Every API server fails its requests now and answers 503 for its grace period.
            await anyio.to_thread.run_sync(self._tell_api_servers_engine_dead, ctx)
            asked = DEAD_ENGINE_GRACE + 10
        await stop_processes_async(self.apis, asked_first=asked, grace=30)
        self._stop_nodes(handshake_sock)
        await stop_processes_async(others, grace=30)
        return 1

    def _tell_api_servers_engine_dead(self, ctx: zmq.Context) -> None:
        assert self.addresses is not None
        for address in self.addresses.api_outputs:
            push = open_socket(ctx, zmq.PUSH, address, bind=False, secret=self.dp.secret, linger=2000).socket
            push.setsockopt(zmq.SNDTIMEO, 2000)
            try:
                push.send(ENGINE_CORE_DEAD)
            except zmq.Again:
                pass  # that API server is gone already
            push.close()

    def _stop_nodes(self, handshake_sock: AsyncSocket | None) -> None:
        if handshake_sock is None:
            return
        for identity in self.nodes:
            try:
                handshake_sock.send_nowait([identity, handshake.STOP])
            except zmq.ZMQError:
                pass
