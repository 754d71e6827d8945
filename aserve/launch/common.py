"""What both kinds of node share: this node's part of a data-parallel server, and the
supervisor's watching tasks (the first child to exit, the first signal, why the tree is
coming down)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass

import anyio

#: vLLM's default ``--data-parallel-rpc-port``.
DEFAULT_DP_RPC_PORT = 13345


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


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


async def first_exit(procs: list[mp.process.BaseProcess]) -> mp.process.BaseProcess:
    """The first of ``procs`` to exit (they are watched through their sentinels)."""
    result: list[mp.process.BaseProcess] = []

    async def watch(proc: mp.process.BaseProcess, scope: anyio.CancelScope) -> None:
        await anyio.wait_readable(proc.sentinel)
        result.append(proc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        for proc in procs:
            tg.start_soon(watch, proc, tg.cancel_scope)
    return result[0]


async def first_signal() -> int:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            return signum
    raise AssertionError("unreachable")


class Outcome:
    """Why the tree is coming down: the first event wins."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.graceful = False

    def set(self, reason: str, *, graceful: bool, scope: anyio.CancelScope) -> None:
        if self.reason is None:
            self.reason, self.graceful = reason, graceful
        scope.cancel()
