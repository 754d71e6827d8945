"""``aserve run``: the supervisor owns the process tree, the listening socket and signals.

A front-end node (the default) starts, for ``--dp D --tp T --api-server-count A``::

    aserve::supervisor
    ├── aserve::api_server_0 .. A-1      (share the one listening socket)
    ├── aserve::coordinator              (when D > 1)
    └── aserve::engine_core_0 .. L-1     (L = --dp-size-local, default D)
        └── aserve::worker_tp0 .. T-1    (each engine is its own TP group)

On one machine every wire is an ``ipc://`` file in the instance's private directory.
When some engines run on headless nodes (``--dp-size-local`` < ``--dp``), the API
servers and the coordinator bind ``tcp://--dp-address:0`` (CURVE-authenticated by the
DP secret) and report the ports the kernel gave them; the supervisor then answers
headless nodes' handshakes on ``--dp-address:--dp-rpc-port`` with those addresses.

The supervisor is one anyio task tree that watches every child. A child that exits on
its own (or a headless node that reports a failure) brings the tree down: the API
servers are told at once (``ENGINE_CORE_DEAD``), answer 503 for a short grace, and
everything is stopped; the status is 1. SIGTERM/SIGINT drain the API servers first,
then stop the engines and the nodes; the status is 0. Children exit when their parent
dies; the supervisor removes the instance's shared memory and IPC files on every exit
path it survives (an orphaned engine core does it when the supervisor does not).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import socket
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from aserve.api.server import DEAD_ENGINE_GRACE, ApiServerConfig, run_api_server
from aserve.errors import HandshakeRefusedError, unwrap_errors
from aserve.frontend.async_llm import EngineAttachment
from aserve.frontend.engine_args import make_engine_config
from aserve.launch.engines import create_heartbeats, spawn_coordinator, spawn_engine_cores
from aserve.launch.process_utils import cleanup_instance, ignore_termination, set_process_title, skip_resource_tracker
from aserve.wire import handshake
from aserve.wire.addresses import WireAddresses, ipc_addresses, tcp_bind_address
from aserve.wire.auth import secure_client, secure_server
from aserve.wire.codec import ENGINE_CORE_DEAD
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.supervisor")

#: vLLM's default ``--data-parallel-rpc-port``.
DEFAULT_DP_RPC_PORT = 13345
#: Seconds between two log lines about peers that fail the CURVE handshake.
REFUSAL_LOG_INTERVAL = 10.0
#: Seconds to wait for a child to report the ports it bound.
REPORT_TIMEOUT = 120.0


@dataclass(frozen=True)
class DataParallelLaunch:
    """This node's part of a data-parallel server (CLI: ``--dp``, ``--dp-size-local``, ...)."""

    size: int = 1
    size_local: int | None = None  # engines on this node; default: all
    start_rank: int = 0  # DP rank of this node's first engine (headless nodes)
    api_server_count: int | None = None  # default: size
    address: str = "127.0.0.1"  # where the front end's TCP wires and handshake listen
    rpc_port: int = DEFAULT_DP_RPC_PORT
    secret: bytes | None = None
    headless: bool = False

    @property
    def local(self) -> int:
        return self.size if self.size_local is None else self.size_local

    @property
    def multi_node(self) -> bool:
        return self.headless or self.local < self.size


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def model_name(model: str | None) -> str:
    return Path(model).name if model else "aserve-default"


def run_server(cfg: ApiServerConfig, host: str, port: int, dp: DataParallelLaunch | None = None) -> int:
    """Start a front-end node's tree, run until it stops, return the exit status."""
    dp = dp or DataParallelLaunch()
    _configure_logging(cfg.log_level)
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
    instance_dir = tempfile.mkdtemp(prefix=f"{instance_id}-")
    try:
        return anyio.run(_FrontEnd(cfg, host, port, dp, instance_id, instance_dir).run)
    finally:
        cleanup_instance(instance_id, instance_dir)


def run_headless(engine_kwargs: dict[str, Any], served_model_name: str, dp: DataParallelLaunch,
                 log_level: str = "INFO") -> int:
    """Start a headless node (engines and workers only), serve until the front end stops."""
    _configure_logging(log_level)
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
    instance_dir = tempfile.mkdtemp(prefix=f"{instance_id}-")
    try:
        return anyio.run(_Headless(engine_kwargs, served_model_name, dp, instance_id, instance_dir).run)
    finally:
        cleanup_instance(instance_id, instance_dir)


# -- helpers shared by both kinds of node ---------------------------------------------------


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def _stop(proc: mp.process.BaseProcess, grace: float) -> None:
    if proc.exitcode is None:
        proc.terminate()
        proc.join(grace)
    if proc.exitcode is None:
        logger.error("%s did not stop in %.0f s; killing it", proc.name, grace)
        proc.kill()
        proc.join()


async def _stop_all(procs: list[mp.process.BaseProcess], grace: float) -> None:
    """SIGTERM all at once, then wait (SIGKILL after ``grace``)."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        await anyio.to_thread.run_sync(_stop, proc, grace)


async def _receive_report(reader: multiprocessing.connection.Connection, proc: mp.process.BaseProcess) -> list[str]:
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


async def _first_exit(procs: list[mp.process.BaseProcess]) -> mp.process.BaseProcess:
    result: list[mp.process.BaseProcess] = []

    async def watch(proc: mp.process.BaseProcess, scope: anyio.CancelScope) -> None:
        await anyio.wait_readable(proc.sentinel)
        result.append(proc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        for proc in procs:
            tg.start_soon(watch, proc, tg.cancel_scope)
    return result[0]


async def _first_signal() -> int:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            return signum
    raise AssertionError("unreachable")


class _Outcome:
    """Why the tree is coming down: the first event wins."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.graceful = False

    def set(self, reason: str, *, graceful: bool, scope: anyio.CancelScope) -> None:
        if self.reason is None:
            self.reason, self.graceful = reason, graceful
        scope.cancel()


# -- the front-end node -----------------------------------------------------------------------


class _FrontEnd:
    def __init__(self, cfg: ApiServerConfig, host: str, port: int, dp: DataParallelLaunch, instance_id: str,
                 instance_dir: str) -> None:
        self.cfg, self.host, self.port, self.dp = cfg, host, port, dp
        self.instance_id, self.instance_dir = instance_id, instance_dir
        self.api_count = dp.api_server_count or dp.size
        self.apis: list[mp.process.BaseProcess] = []
        self.engines: dict[int, mp.process.BaseProcess] = {}
        self.coordinator: mp.process.BaseProcess | None = None
        self.addresses: WireAddresses | None = None
        self.nodes: dict[bytes, range] = {}  # headless nodes that were welcomed: identity -> DP ranks

    async def run(self) -> int:
        cfg, dp = self.cfg, self.dp
        kwargs = {k: v for k, v in cfg.engine_kwargs.items() if k != "heartbeat_timeout"}
        config = make_engine_config(**kwargs, data_parallel_size_local=dp.local)
        tp = config.parallel.tensor_parallel_size
        sock = bind_socket(self.host, self.port)
        bound_port = sock.getsockname()[1]
        heartbeat_name = create_heartbeats(self.instance_id, config, range(dp.size))  # removed by cleanup_instance
        local_ranks = range(dp.local)
        spawn = mp.get_context("spawn")
        ctx = zmq.Context()
        handshake_sock: AsyncSocket | None = None
        try:
            if not dp.multi_node:
                self.addresses = ipc_addresses(self.instance_dir, self.api_count, coordinator=dp.size > 1)
                if dp.size > 1:
                    self.coordinator = spawn_coordinator(dp.size, self.addresses)
                self.engines = spawn_engine_cores(config, self.addresses, local_ranks, instance_id=self.instance_id,
                                                  instance_dir=self.instance_dir, heartbeat_name=heartbeat_name)
                engine_pids = {rank: proc.pid for rank, proc in self.engines.items()}
                for i in range(self.api_count):
                    attach = EngineAttachment(self.instance_id, self.instance_dir, self.addresses, engine_pids,
                                              tuple(local_ranks), client_index=i)
                    self.apis.append(self._spawn_api(spawn, sock, i, attach, None))
            else:
                await self._start_multi_node(spawn, sock, config, local_ranks, heartbeat_name)
                handshake_sock = self._bind_handshake(ctx)
            sock.close()  # the API servers hold their own copies
            self._announce(bound_port, tp)

            outcome = _Outcome()
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
            procs = [*self.apis, *self.engines.values(), *([self.coordinator] if self.coordinator else [])]
            for proc in procs:  # start-up failed part-way, or anything left
                _stop(proc, 30)

    def _spawn_api(self, spawn: Any, sock: socket.socket, index: int, attach: EngineAttachment,
                   report: Any) -> mp.process.BaseProcess:
        attach = dataclasses.replace(attach, report=report)
        api_cfg = dataclasses.replace(self.cfg, index=index, attach=attach)
        proc = spawn.Process(target=run_api_server, args=(api_cfg, sock), name=f"api_server_{index}")
        proc.start()
        return proc

    async def _start_multi_node(self, spawn: Any, sock: socket.socket, config: Any, local_ranks: range,
                                heartbeat_name: str) -> None:
        """TCP wires: the coordinator and API servers bind port 0 and report; then the
        local engines start with the addresses they reported."""
        dp, bind = self.dp, tcp_bind_address(self.dp.address)
        publish = f"ipc://{self.instance_dir}/coordinator_publish"  # only this node's API servers subscribe
        coordinator_input = coordinator_stats = None
        if dp.size > 1:
            reader, writer = mp.Pipe(duplex=False)
            self.coordinator = spawn_coordinator(
                dp.size, WireAddresses((), (), bind, bind, publish), secret=dp.secret, report=writer)
            writer.close()
            coordinator_input, coordinator_stats, _ = await _receive_report(reader, self.coordinator)
        binds = WireAddresses((bind,) * self.api_count, (bind,) * self.api_count,
                              coordinator_publish=publish if dp.size > 1 else None)
        readers = []
        for i in range(self.api_count):
            reader, writer = mp.Pipe(duplex=False)
            attach = EngineAttachment(self.instance_id, self.instance_dir, binds, {}, tuple(local_ranks),
                                      client_index=i, secret=dp.secret)
            self.apis.append(self._spawn_api(spawn, sock, i, attach, writer))
            writer.close()
            readers.append(reader)
        reports = [await _receive_report(reader, proc) for reader, proc in zip(readers, self.apis)]
        self.addresses = WireAddresses(
            api_inputs=tuple(r[0] for r in reports), api_outputs=tuple(r[1] for r in reports),
            coordinator_input=coordinator_input, coordinator_stats=coordinator_stats,
            coordinator_publish=publish if dp.size > 1 else None,
        )
        self.engines = spawn_engine_cores(config, self.addresses, local_ranks, instance_id=self.instance_id,
                                          instance_dir=self.instance_dir, heartbeat_name=heartbeat_name,
                                          secret=dp.secret)

    def _bind_handshake(self, ctx: zmq.Context) -> AsyncSocket:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        secure_server(router, self.dp.secret)
        host = f"[{self.dp.address}]" if ":" in self.dp.address else self.dp.address
        router.bind(f"tcp://{host}:{self.dp.rpc_port}")
        return AsyncSocket(router)

    def _announce(self, port: int, tp: int) -> None:
        cfg, dp = self.cfg, self.dp
        scheme = "https" if cfg.ssl_certfile else "http"
        print(f"aserve: serving {cfg.served_model_name} at {scheme}://{self.host}:{port}/v1", flush=True)
        workers = ", ".join(f"aserve::worker_tp{r}" for r in range(tp))
        engines = ", ".join(f"aserve::engine_core_{d} -> [{workers}]" for d in range(dp.local))
        apis = ", ".join(f"aserve::api_server_{i}" for i in range(self.api_count))
        coordinator = "aserve::coordinator, " if self.coordinator is not None else ""
        print(f"aserve: process tree: aserve::supervisor -> [{apis}, {coordinator}{engines}]", flush=True)
        if dp.local < dp.size:
            print(f"aserve: waiting for headless nodes with DP ranks {dp.local}..{dp.size - 1} on "
                  f"tcp://{dp.address}:{dp.rpc_port}", flush=True)

    # -- the watching tasks --------------------------------------------------------------

    async def _watch_children(self, outcome: _Outcome, scope: anyio.CancelScope) -> None:
        procs = [*self.apis, *self.engines.values(), *([self.coordinator] if self.coordinator else [])]
        proc = await _first_exit(procs)
        outcome.set(f"{proc.name} exited (code {proc.exitcode})", graceful=False, scope=scope)

    async def _watch_signals(self, outcome: _Outcome, scope: anyio.CancelScope) -> None:
        signum = await _first_signal()
        for api in self.apis:  # at once: /ready must turn 503 now
            if api.exitcode is None:
                api.terminate()
        outcome.set(f"signal {signal.Signals(signum).name}", graceful=True, scope=scope)

    async def _serve_nodes(self, router: AsyncSocket, outcome: _Outcome, scope: anyio.CancelScope) -> None:
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
                                                   tp_size=self.cfg.engine_kwargs.get("tensor_parallel_size", 1),
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

    async def _shut_down(self, outcome: _Outcome, ctx: zmq.Context, handshake_sock: AsyncSocket | None) -> int:
        others = [*self.engines.values(), *([self.coordinator] if self.coordinator else [])]
        if outcome.graceful:
            logger.info("stopping (%s): draining the API servers", outcome.reason)
            # Drain: the API servers finish (or abort) their requests, then the engines stop.
            for api in self.apis:
                await anyio.to_thread.run_sync(_stop, api, self.cfg.shutdown_timeout + 60)
            self._stop_nodes(handshake_sock)
            await _stop_all(others, 60)
            return 0
        logger.error("%s; stopping the server", outcome.reason)
        if any(api.exitcode is None for api in self.apis):
            # Every API server fails its requests now and answers 503 for its grace period.
            await anyio.to_thread.run_sync(self._tell_api_servers_engine_dead, ctx)
            for api in self.apis:
                await anyio.to_thread.run_sync(api.join, DEAD_ENGINE_GRACE + 10)
        self._stop_nodes(handshake_sock)
        await _stop_all([*self.apis, *others], 30)
        return 1

    def _tell_api_servers_engine_dead(self, ctx: zmq.Context) -> None:
        assert self.addresses is not None
        for address in self.addresses.api_outputs:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDTIMEO, 2000)
            push.setsockopt(zmq.LINGER, 2000)
            if address.startswith("tcp://"):
                secure_client(push, self.dp.secret)
            push.connect(address)
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


# -- a headless node ------------------------------------------------------------------------------


class _Headless:
    HANDSHAKE_TIMEOUT = 60.0

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str, dp: DataParallelLaunch,
                 instance_id: str, instance_dir: str) -> None:
        self.engine_kwargs, self.served_model_name, self.dp = engine_kwargs, served_model_name, dp
        self.instance_id, self.instance_dir = instance_id, instance_dir
        self.engines: dict[int, mp.process.BaseProcess] = {}

    async def run(self) -> int:
        dp = self.dp
        kwargs = {k: v for k, v in self.engine_kwargs.items() if k != "heartbeat_timeout"}
        config = make_engine_config(**kwargs, data_parallel_size_local=dp.local)
        ranks = range(dp.start_rank, dp.start_rank + dp.local)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        secure_client(dealer, dp.secret)
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | \
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
        monitor = AsyncSocket(dealer.get_monitor_socket(events))
        host = f"[{dp.address}]" if ":" in dp.address else dp.address
        front_end = f"tcp://{host}:{dp.rpc_port}"
        dealer.connect(front_end)
        sock = AsyncSocket(dealer)
        try:
            hello = handshake.NodeHello(dp.size, dp.start_rank, dp.local, config.parallel.tensor_parallel_size,
                                        self.served_model_name)
            await sock.send_multipart([handshake.HELLO, msgspec.msgpack.encode(hello)])
            with unwrap_errors():
                addresses = await self._await_welcome(sock, monitor, front_end)
            heartbeat_name = create_heartbeats(self.instance_id, config, ranks)
            self.engines = spawn_engine_cores(config, addresses, ranks, instance_id=self.instance_id,
                                              instance_dir=self.instance_dir, heartbeat_name=heartbeat_name,
                                              secret=dp.secret)
            print(f"aserve: headless node: DP ranks {ranks.start}..{ranks.stop - 1} joined {front_end}", flush=True)
            outcome = _Outcome()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_engines, outcome, tg.cancel_scope)
                tg.start_soon(self._watch_front_end, sock, monitor, outcome, tg.cancel_scope)
                tg.start_soon(self._watch_signals, outcome, tg.cancel_scope)
            ignore_termination()
            with anyio.CancelScope(shield=True):
                if not outcome.graceful:
                    logger.error("%s; stopping this node", outcome.reason)
                    try:
                        sock.send_nowait([handshake.FAILED, (outcome.reason or "").encode()])
                    except zmq.ZMQError:
                        pass
                else:
                    logger.info("stopping this node (%s)", outcome.reason)
                await _stop_all(list(self.engines.values()), 60)
            return 0 if outcome.graceful else 1
        finally:
            ignore_termination()
            dealer.disable_monitor()
            monitor.close()
            sock.close(linger=1000)  # let FAILED reach the front end
            ctx.term()
            for proc in self.engines.values():
                _stop(proc, 30)

    async def _await_welcome(self, sock: AsyncSocket, monitor: AsyncSocket, front_end: str) -> WireAddresses:
        result: list[WireAddresses] = []

        async def reply(scope: anyio.CancelScope) -> None:
            while True:
                frames = await sock.recv_multipart()
                if frames[0] == handshake.REFUSED:
                    raise HandshakeRefusedError(f"the front end refused this node: {bytes(frames[1]).decode()}")
                if frames[0] == handshake.WELCOME:
                    result.append(msgspec.msgpack.decode(frames[1], type=WireAddresses))
                    scope.cancel()
                    return

        async def refusal() -> None:
            while True:
                event = await monitor.recv_multipart()
                kind = int.from_bytes(event[0][:2], "little")
                if kind != zmq.EVENT_DISCONNECTED:
                    raise HandshakeRefusedError(f"{front_end} refused this node's CURVE handshake: the DP secret "
                                           "differs from the front end's")

        try:
            with anyio.fail_after(self.HANDSHAKE_TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(reply, tg.cancel_scope)
                    tg.start_soon(refusal)
        except TimeoutError:
            raise HandshakeRefusedError(f"no answer from {front_end} in {self.HANDSHAKE_TIMEOUT:.0f} s") from None
        return result[0]

    async def _watch_engines(self, outcome: _Outcome, scope: anyio.CancelScope) -> None:
        proc = await _first_exit(list(self.engines.values()))
        outcome.set(f"{proc.name} exited (code {proc.exitcode})", graceful=False, scope=scope)

    async def _watch_front_end(self, sock: AsyncSocket, monitor: AsyncSocket, outcome: _Outcome,
                               scope: anyio.CancelScope) -> None:
        async def stop_message() -> None:
            while True:
                frames = await sock.recv_multipart()
                if frames[0] == handshake.STOP:
                    outcome.set("the front end stopped the server", graceful=True, scope=scope)
                    return

        async def disconnect() -> None:
            while True:
                event = await monitor.recv_multipart()
                if int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                    outcome.set("the front end went away", graceful=True, scope=scope)
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_message)
            tg.start_soon(disconnect)

    async def _watch_signals(self, outcome: _Outcome, scope: anyio.CancelScope) -> None:
        signum = await _first_signal()
        outcome.set(f"signal {signal.Signals(signum).name}", graceful=True, scope=scope)
