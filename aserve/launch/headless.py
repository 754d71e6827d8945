"""A headless node of ``aserve run --headless``: engines and their workers only, serving
the front-end node at ``--dp-address``.

The node says which DP ranks it runs (``aserve.wire.handshake``), gets the front end's
wire addresses, starts its engines with the config it fitted itself (its own devices),
and exits when the front end stops it, goes away, or one of its engines dies (which it
reports, so the whole server comes down).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal

import anyio
import msgspec
import zmq

from aserve.engine.fit import FittedConfig
from aserve.engine.spawn import create_heartbeats, spawn_engine_cores
from aserve.errors import HandshakeRefusedError, unwrap_errors
from aserve.launch.common import DataParallelLaunch, Outcome, first_exit, first_signal
from aserve.process.instance import Instance
from aserve.process.stop import stop_processes, stop_processes_async
from aserve.process.utils import ignore_termination
from aserve.wire import handshake
from aserve.wire.addresses import WireAddresses
from aserve.wire.sockets import open_socket
from aserve.wire.zmq_anyio import AsyncSocket

logger = logging.getLogger("aserve.supervisor")


class Headless:
    HANDSHAKE_TIMEOUT = 60.0

    def __init__(self, fitted: FittedConfig, served_model_name: str, dp: DataParallelLaunch,
                 instance: Instance) -> None:
        """``fitted``: the engine config, fitted on this node (its own devices)."""
        self.fitted, self.served_model_name, self.dp, self.instance = fitted, served_model_name, dp, instance
        self.engines: dict[int, mp.process.BaseProcess] = {}

    async def run(self) -> int:
        dp, fitted = self.dp, self.fitted
        tp, pp = fitted.config.parallel.tensor_parallel_size, fitted.config.parallel.pipeline_parallel_size
        ranks = range(dp.start_rank, dp.start_rank + dp.local)
        ctx = zmq.Context()
        host = f"[{dp.address}]" if ":" in dp.address else dp.address
        front_end = f"tcp://{host}:{dp.rpc_port}"
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | \
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
        # The monitor must watch the connection from its first attempt: open, monitor, connect.
        sock = open_socket(ctx, zmq.DEALER, front_end, bind=False, secret=dp.secret, linger=1000, connect=False)
        dealer = sock.socket
        monitor = AsyncSocket(dealer.get_monitor_socket(events))
        dealer.connect(front_end)
        try:
            hello = handshake.NodeHello(dp.size, dp.start_rank, dp.local, tp, self.served_model_name, pp)
            await sock.send_multipart([handshake.HELLO, msgspec.msgpack.encode(hello)])
            with unwrap_errors():
                addresses = await self._await_welcome(sock, monitor, front_end)
            heartbeat_name = create_heartbeats(self.instance, tp * pp, ranks)
            self.engines = spawn_engine_cores(fitted, addresses, ranks, instance=self.instance,
                                              heartbeat_name=heartbeat_name, secret=dp.secret)
            print(f"aserve: headless node: DP ranks {ranks.start}..{ranks.stop - 1} joined {front_end}", flush=True)
            outcome = Outcome()
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
                await stop_processes_async(list(self.engines.values()), grace=60)
            return 0 if outcome.graceful else 1
        finally:
            ignore_termination()
            dealer.disable_monitor()
            monitor.close()
            sock.close(linger=1000)  # let FAILED reach the front end
            ctx.term()
            stop_processes(list(self.engines.values()), grace=30)

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

    async def _watch_engines(self, outcome: Outcome, scope: anyio.CancelScope) -> None:
        proc = await first_exit(list(self.engines.values()))
        outcome.set(f"{proc.name} exited (code {proc.exitcode})", graceful=False, scope=scope)

    async def _watch_front_end(self, sock: AsyncSocket, monitor: AsyncSocket, outcome: Outcome,
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

    async def _watch_signals(self, outcome: Outcome, scope: anyio.CancelScope) -> None:
        signum = await first_signal()
        outcome.set(f"signal {signal.Signals(signum).name}", graceful=True, scope=scope)
