"""``aserve run``: the supervisor owns the process tree, the listening socket and signals.

It binds the HTTP socket once and hands it to the API-server process, which starts the
engine core (and the engine core its workers). SIGTERM/SIGINT are forwarded to the API
server, which drains (see ``aserve.api.server``); if the API server exits on its own
(for example because the engine died), the supervisor exits with its status. Children
exit when their parent dies.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import time
from pathlib import Path

from aserve.api.server import ApiServerConfig, run_api_server
from aserve.launch.process_utils import set_process_title, skip_resource_tracker

logger = logging.getLogger("aserve.supervisor")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(cfg: ApiServerConfig, host: str, port: int) -> int:
    """Run until the server stops; returns the exit status."""
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    sock = bind_socket(host, port)
    scheme = "https" if cfg.ssl_certfile else "http"
    actual_port = sock.getsockname()[1]
    api = mp.get_context("spawn").Process(target=run_api_server, args=(cfg, sock), name="api_server_0")
    api.start()
    sock.close()  # the API server holds its own copy
    print(f"aserve: serving {cfg.served_model_name} at {scheme}://{host}:{actual_port}/v1", flush=True)
    print("aserve: process tree: aserve::supervisor -> aserve::api_server_0 -> aserve::engine_core_0 -> "
          f"aserve::worker_tp0..{cfg.engine_kwargs.get('tensor_parallel_size', 1) - 1}", flush=True)

    stopping = False

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping and api.exitcode is None:
            api.terminate()  # SIGTERM: the API server drains (once; it ignores repeats)
        stopping = True

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while api.exitcode is None:
        api.join(timeout=1.0)
        if stopping and api.exitcode is None:
            deadline = time.monotonic() + cfg.shutdown_timeout + 60
            while api.exitcode is None and time.monotonic() < deadline:
                api.join(timeout=1.0)
            if api.exitcode is None:
                logger.error("the API server did not stop in time; killing it")
                api.kill()
                api.join()
    code = api.exitcode or 0
    if stopping and code in (0, -signal.SIGTERM):
        return 0
    return 1 if code else 0


def model_name(model: str | None) -> str:
    return Path(model).name if model else "aserve-default"
