"""``aserve run``: the supervisor owns the process tree, the listening socket and signals.

A front-end node (the default) starts, for ``--dp D --tp T --api-server-count A``::

    aserve::supervisor
    ├── aserve::api_server_0 .. A-1      (share the one listening socket)
    ├── aserve::coordinator              (when D > 1)
    └── aserve::engine_core_0 .. L-1     (L = --dp-size-local, default D)
        └── aserve::worker_tp0 .. T-1    (each engine is its own TP group)

(``aserve.launch.front_end``; a ``--headless`` node starts only its engines and their
workers, ``aserve.launch.headless``.) Before any process starts, the command line has
been turned into one ``EngineArgs``, fitted to the model once (``aserve.engine.fit``),
and the listening socket bound (``aserve.launch.startup``): every child gets that fitted
config, so a mistake is reported in one line by the command, not by a child.

The supervisor is one anyio task tree that watches every child. A child that exits on
its own (or a headless node that reports a failure) brings the tree down: the API
servers are told at once (``ENGINE_CORE_DEAD``), answer 503 for a short grace, and
everything is stopped; the status is 1. SIGTERM/SIGINT drain the API servers first,
then stop the engines and the nodes; the status is 0. Children exit when their parent
dies; the supervisor removes the instance's shared memory and IPC files on every exit
path it survives (an orphaned engine core does it when the supervisor does not).
"""

from __future__ import annotations

import socket

import anyio

from aserve.api.server import ApiServerConfig
from aserve.engine.fit import FittedConfig
from aserve.launch.common import DataParallelLaunch, configure_logging
from aserve.launch.front_end import FrontEnd
from aserve.launch.headless import Headless
from aserve.process.instance import Instance
from aserve.process.utils import set_process_title, skip_resource_tracker


def run_server(cfg: ApiServerConfig, sock: socket.socket, host: str, dp: DataParallelLaunch | None = None) -> int:
    """Start a front-end node's tree on ``sock`` (bound to ``host`` and listening), run
    until it stops, return the exit status. ``cfg.fitted`` is the fitted engine config."""
    dp = dp or DataParallelLaunch()
    configure_logging(cfg.log_level)
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    instance = Instance.create()
    try:
        return anyio.run(FrontEnd(cfg, sock, host, dp, instance).run)
    finally:
        instance.cleanup()


def run_headless(fitted: FittedConfig, served_model_name: str, dp: DataParallelLaunch, log_level: str = "INFO") -> int:
    """Start a headless node (engines and workers only), serve until the front end stops."""
    configure_logging(log_level)
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    instance = Instance.create()
    try:
        return anyio.run(Headless(fitted, served_model_name, dp, instance).run)
    finally:
        instance.cleanup()
